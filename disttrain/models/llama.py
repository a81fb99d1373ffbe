"""The Llama family: pre-RMSNorm decoder, rotary positions (Hugging Face's rotate-half layout,
`model.rope_theta`, Llama 3's frequency scaling), grouped-query attention (`model.num_kv_heads`
K/V heads shared by `model.num_heads` query heads), SwiGLU MLP, no biases.

Hugging Face's `LlamaForCausalLM` is this model (HF_NAMES: hf_names.llama_layout); named
sizes, including the published shapes of SmolLM2-135M and Llama 3.2 1B, are in launch/configs/llama.py.
K/V heads name the logical axis 'kv_heads': split over `tensor` when their count divides it,
whole otherwise (disttrain/parallel/sharding.py).
"""

from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.models import gpt, layers
from disttrain.models.decoder import Decoder, DecoderConfig, resolve_remat
from disttrain.models.language_model import LanguageModel
from disttrain.models.hf_names import llama_layout


def default_mlp_dim(width: int) -> int:
  """Meta's SwiGLU width for model.mlp_dim=0: 2/3 of 4 x width, rounded up to a multiple of 256."""
  return -(-int(8 * width / 3) // 256) * 256


def decoder_config(cfg: ModelConfig, dtype, context: int) -> DecoderConfig:
  """The decoder a Llama model config describes."""
  del context  # rotary positions have no table
  if not cfg.head_dim:
    gpt.check_heads(cfg)
  kv_heads = cfg.num_kv_heads or cfg.num_heads
  if cfg.num_heads % kv_heads:
    raise ConfigError(f'model.num_kv_heads={kv_heads} does not divide model.num_heads='
                      f'{cfg.num_heads}; each K/V head serves a whole group of query heads')
  if cfg.norm not in ('', 'rmsnorm'):
    raise ConfigError(f"model.norm={cfg.norm!r}: the Llama family uses RMSNorm; set 'rmsnorm' "
                      "or leave it ''")
  head_dim = cfg.head_dim or cfg.hidden // cfg.num_heads
  if head_dim % 2:
    raise ConfigError(f'the head size {head_dim} (model.head_dim, or model.hidden / '
                      'model.num_heads) is odd; rotary embeddings rotate pairs of features, so '
                      'use an even head size')
  scaling = layers.RopeScaling(**vars(cfg.rope_scaling)) if cfg.rope_scaling.kind else \
      layers.RopeScaling()
  inv_freq = layers.rope_frequencies(head_dim, cfg.rope_theta, scaling)
  return DecoderConfig(
      vocab_size=cfg.vocab_size, width=cfg.hidden, num_layers=cfg.num_layers,
      num_heads=cfg.num_heads, num_kv_heads=kv_heads, mlp_dim=cfg.mlp_dim or
      default_mlp_dim(cfg.hidden), mlp='swiglu', norm='rmsnorm', norm_eps=cfg.norm_eps,
      use_bias=False, fused_qkv=False, learned_positions=0, rope=tuple(float(f) for f in inv_freq),
      tied_embeddings=cfg.tied_embeddings, dropout=cfg.dropout, remat=resolve_remat(cfg.remat),
      scan_unroll=cfg.scan_unroll,
      attention=cfg.attention, attention_block=cfg.attention_block, dtype=dtype,
      head_size=cfg.head_dim, sliding_window=cfg.sliding_window, **gpt.decoder_moe(cfg))


def build(cfg: ModelConfig, dtype, context: int) -> LanguageModel:
  return LanguageModel(Decoder(decoder_config(cfg, dtype, context)), family='llama')


HF_NAMES = {'llama': llama_layout()}

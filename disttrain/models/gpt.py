"""The GPT-2 family: pre-LayerNorm decoder, learned positions, fused QKV with biases, GELU MLP.

Hugging Face's `GPT2LMHeadModel` is this model (HF_NAMES below names its weights); the
example sizes are in launch/configs/gpt.py. Logical axes as in disttrain/models/layers.py; the
positions table has `model.max_seq_len` rows (0 = data.seq_len), GPT-2's n_positions.
"""

from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.models.decoder import Decoder, DecoderConfig, resolve_remat
from disttrain.models.language_model import LanguageModel
from disttrain.models.hf_names import Tensor


def check_heads(cfg: ModelConfig) -> None:
  if cfg.hidden % cfg.num_heads:
    raise ConfigError(f'model.hidden={cfg.hidden} is not divisible by model.num_heads='
                      f'{cfg.num_heads}; use a width that is a multiple of the head count')


def decoder_moe(cfg: ModelConfig) -> dict:
  """The mixture-of-experts fields of a decoder, and its loss chunk (both families read them)."""
  return dict(num_experts=cfg.num_experts, experts_per_token=cfg.experts_per_token,
              expert_capacity=cfg.expert_capacity, router_aux_weight=cfg.router_aux_weight,
              router_z_weight=cfg.router_z_weight, router_balance=cfg.router_balance,
              moe_norm_topk=cfg.moe_norm_topk,
              loss_chunk=cfg.loss_chunk)


def decoder_config(cfg: ModelConfig, dtype, context: int) -> DecoderConfig:
  """The decoder a GPT model config describes (`context`: data.seq_len, the default table size)."""
  check_heads(cfg)
  if cfg.num_kv_heads not in (0, cfg.num_heads):
    raise ConfigError(f'model.num_kv_heads={cfg.num_kv_heads}: the GPT family has one K/V head '
                      f'per query head ({cfg.num_heads}); set 0, or use model.name=llama for '
                      'grouped-query attention')
  if cfg.norm not in ('', 'layernorm', 'rmsnorm'):
    raise ConfigError(f'model.norm={cfg.norm!r}: the GPT family uses layernorm or rmsnorm')
  width = cfg.hidden // cfg.num_heads
  for field, value, ignored in (  # the family builds none of them: accepted, they did nothing
      ('head_dim', cfg.head_dim, cfg.head_dim not in (0, width)),
      ('rope_theta', cfg.rope_theta, cfg.rope_theta != ModelConfig.rope_theta),
      ('rope_scaling.kind', cfg.rope_scaling.kind, bool(cfg.rope_scaling.kind))):
    if ignored:
      raise ConfigError(f'model.{field}={value!r}: the GPT family has learned positions and '
                        f'heads of hidden / num_heads = {width}; leave it at its default, or use '
                        'model.name=llama')
  return DecoderConfig(
      vocab_size=cfg.vocab_size, width=cfg.hidden, num_layers=cfg.num_layers,
      num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim or 4 * cfg.hidden,
      mlp='gelu', norm=cfg.norm or 'layernorm', norm_eps=cfg.norm_eps, use_bias=True,
      fused_qkv=True, learned_positions=cfg.max_seq_len or context, rope=None,
      tied_embeddings=cfg.tied_embeddings, dropout=cfg.dropout, remat=resolve_remat(cfg.remat),
      scan_unroll=cfg.scan_unroll,
      attention=cfg.attention, attention_block=cfg.attention_block, dtype=dtype,
      **decoder_moe(cfg))


def build(cfg: ModelConfig, dtype, context: int) -> LanguageModel:
  return LanguageModel(Decoder(decoder_config(cfg, dtype, context)), family='gpt')


def _hf_names() -> list[Tensor]:
  """GPT2LMHeadModel's names: fused QKV and its MLP as Conv1D ([in, out]) weights with biases."""
  layer = 'transformer.h.{i}.'
  table = [Tensor('embed', 'transformer.wte.weight', 'embedding'),
           Tensor('positions', 'transformer.wpe.weight')]
  for ours, hf, n_in in (('attention/qkv', 'attn.c_attn', 1), ('attention/out', 'attn.c_proj', 2),
                         ('mlp/mlp_in', 'mlp.c_fc', 1), ('mlp/mlp_out', 'mlp.c_proj', 1)):
    table += [Tensor(f'blocks/{ours}/kernel', f'{layer}{hf}.weight', 'conv1d', n_in),
              Tensor(f'blocks/{ours}/bias', f'{layer}{hf}.bias')]
  for ours, hf in (('blocks/attention_norm', layer + 'ln_1'), ('blocks/mlp_norm', layer + 'ln_2'),
                   ('final_norm', 'transformer.ln_f')):
    table += [Tensor(f'{ours}/scale', f'{hf}.weight'), Tensor(f'{ours}/bias', f'{hf}.bias')]
  return table + [Tensor('unembed/kernel', 'lm_head.weight', 'lm_head')]  # when untied


HF_NAMES = {'gpt': _hf_names()}

"""The Gemma families (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`, the text models): Llama's
decoder with Gemma's parts, all on disttrain/models/decoder.py's one scan.

  both     embeddings x sqrt(width); RMSNorm as x / rms(x) x (1 + w) (weights stored as w); norms
           before and after attention and the MLP; GeGLU MLP (tanh-form GELU on the gate); the
           attention scaled by query_pre_attn_scalar^-1/2 (model.query_pre_attn_scalar);
           tied embeddings; local (sliding-window) and global layers in a pattern: every
           model.sliding_window_pattern-th layer global, the rest attend to the last
           model.sliding_window positions.
  gemma2   attention logits capped at 50 tanh(x / 50) and the final logits at 30 tanh(x / 30)
           (model.attn_softcap, model.final_softcap); pattern 2 (alternating); one rotary base.
  gemma3   RMSNorm (1 + w) over each head's queries and keys; pattern 6 (5 local : 1 global);
           local layers rotate with model.local_rope_theta (10,000), global ones with
           model.rope_theta (1,000,000; linear scaling in model.rope_scaling beyond 1B); no caps.

A layer's window and rotary frequencies are scanned values, so the local/global pattern still
compiles as one block, whatever the depth. Attention soft-capping runs on the xla attention only
(attention.py); the stage split (mesh.stage) does not take a layer pattern yet. Weight names are
below (HF_NAMES), config.json in disttrain/hf/gemma_config.py, sizes in
launch/configs/gemma.py.
"""

import dataclasses

from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.models import layers, llama
from disttrain.models.decoder import Decoder, DecoderConfig
from disttrain.models.language_model import LanguageModel
from disttrain.models.hf_names import Tensor

PATTERN = {'gemma2': 2, 'gemma3': 6}  # the published configs' every-Nth-layer-global


def decoder_config(cfg: ModelConfig, dtype, context: int, family: str) -> DecoderConfig:
  if cfg.attn_softcap and cfg.attention in ('cudnn', 'blockwise'):
    raise ConfigError(f'model.attn_softcap={cfg.attn_softcap} runs on the xla attention only, '
                      f'not model.attention={cfg.attention!r}; set model.attention=xla or auto')
  if cfg.norm not in ('', 'rmsnorm'):  # it built Gemma's own (1 + scale) RMSNorm regardless
    raise ConfigError(f"model.norm={cfg.norm!r}: the Gemma family uses its RMSNorm; set 'rmsnorm' "
                      "or ''")
  base = llama.decoder_config(dataclasses.replace(cfg, norm='rmsnorm'), dtype, context)
  head_dim = base.head_dim
  pattern = cfg.sliding_window_pattern  # 0: every layer alike (cfg.sliding_window or none)
  windows = tuple(cfg.sliding_window if (i + 1) % pattern else 0
                  for i in range(cfg.num_layers)) if cfg.sliding_window and pattern else ()
  local_rope = None
  if windows and cfg.local_rope_theta:
    local_rope = tuple(float(f) for f in layers.rope_frequencies(head_dim, cfg.local_rope_theta))
  return dataclasses.replace(
      base, mlp='geglu', norm='offset_rmsnorm', qk_norm=family == 'gemma3', embed_scale=True,
      sandwich_norms=True, query_scale=(cfg.query_pre_attn_scalar or head_dim) ** -0.5,
      attn_softcap=cfg.attn_softcap, final_softcap=cfg.final_softcap,
      layer_windows=windows, local_rope=local_rope)


def build_family(family: str):
  def build(cfg: ModelConfig, dtype, context: int) -> LanguageModel:
    return LanguageModel(Decoder(decoder_config(cfg, dtype, context, family)), family=family)
  return build


def _hf_names(qk_norm: bool) -> list[Tensor]:
  """Gemma 2 and 3: Llama's projections and MLP, norms before and after each sub-layer (Gemma's
  post_attention_layernorm is after attention, its pre_feedforward_layernorm our mlp_norm)."""
  layer = 'model.layers.{i}.'
  projections = (('query', 'q'), ('key', 'k'), ('value', 'v'))
  return [Tensor('embed', 'model.embed_tokens.weight', 'embedding'),
          Tensor('blocks/attention_norm/scale', layer + 'input_layernorm.weight'),
          *(Tensor(f'blocks/attention/{ours}/kernel', f'{layer}self_attn.{hf}_proj.weight',
                   'linear') for ours, hf in projections),
          *(Tensor(f'blocks/attention/{ours}_norm/scale', f'{layer}self_attn.{hf}_norm.weight')
            for ours, hf in projections[:2] if qk_norm),
          Tensor('blocks/attention/out/kernel', layer + 'self_attn.o_proj.weight', 'linear', 2),
          Tensor('blocks/post_attention_norm/scale', layer + 'post_attention_layernorm.weight'),
          Tensor('blocks/mlp_norm/scale', layer + 'pre_feedforward_layernorm.weight'),
          Tensor('blocks/post_mlp_norm/scale', layer + 'post_feedforward_layernorm.weight'),
          *(Tensor(f'blocks/mlp/{name}/kernel', f'{layer}mlp.{name}_proj.weight', 'linear')
            for name in ('gate', 'up', 'down')),
          Tensor('final_norm/scale', 'model.norm.weight'),
          Tensor('unembed/kernel', 'lm_head.weight', 'lm_head')]


HF_NAMES = {'gemma2': _hf_names(qk_norm=False), 'gemma3': _hf_names(qk_norm=True)}

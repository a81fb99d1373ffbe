"""What a Hugging Face export can hold, and the config.json it writes.

check_exportable refuses, before any time is spent, a model the family's transformers class
would compute differently; for_export writes the run's model fields under the family's keys,
each explicitly (a window, caps, rotary scaling), never left to a family default.
"""

from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.hf import families, gemma_config
from disttrain.models.decoder import DecoderConfig


def check_exportable(model, where: str) -> None:
  """Refuses what no Hugging Face layout here holds (before any time is spent)."""
  if not hasattr(model, 'family'):
    raise ConfigError(f'{where}: a Hugging Face directory holds a language model '
                      f'({", ".join(sorted(families.FAMILIES))}), not this model')
  if model.cfg.num_experts and model.family not in families.MOE:
    raise ConfigError(f'{where} holds a mixture-of-experts model (model.num_experts='
                      f'{model.cfg.num_experts}), which the {model.family} Hugging Face layout '
                      f'has no place for; export a dense model (model.num_experts=0) or train '
                      f'a mixture-of-experts family ({", ".join(families.MOE)})')
  cfg, family = model.cfg, model.family
  if cfg.sliding_window and family not in ('mistral', 'mixtral', *families.GEMMA):
    raise ConfigError(f'{where} attends to a sliding window (model.sliding_window='
                      f'{cfg.sliding_window}), which the {family} Hugging Face model does not '
                      'build (it would attend to every position); export a model trained with '
                      'model.sliding_window=0, or train the mistral family')
  if family == 'mixtral' and not cfg.moe_norm_topk:
    raise ConfigError(f"{where} keeps its top-k gates unnormalised (model.moe_norm_topk=False); "
                      "transformers' Mixtral always renormalises them; export a model trained "
                      'with model.moe_norm_topk=True, or train the qwen3_moe family '
                      '(norm_topk_prob holds the choice)')
  if family == 'gpt' and cfg.norm != 'layernorm':
    raise ConfigError(f"{where} uses model.norm={cfg.norm!r}; GPT-2's Hugging Face model has "
                      'LayerNorm only; export a gpt model trained with model.norm=layernorm')
  scalar = round(cfg.query_scale ** -2, 6) if cfg.query_scale else 0  # query_pre_attn_scalar
  if family in families.GEMMA and scalar != round(scalar):
    raise ConfigError(f'{where} scales attention by model.query_pre_attn_scalar={scalar:g}, and '
                      "transformers' Gemma config holds an integer; export a model trained with "
                      f'a whole number (e.g. {round(scalar)})')
  if family == 'gemma3' and cfg.attn_softcap:
    raise ConfigError(f"{where} caps attention logits (model.attn_softcap={cfg.attn_softcap}), "
                      "which transformers' Gemma 3 does not apply; export a model trained with "
                      'model.attn_softcap=0, or train the gemma2 family')


def for_export(family: str, cfg: ModelConfig, decoder: DecoderConfig, dtype: str,
              special: dict) -> dict:
  """config.json of the exported model; `special`: bos/eos token ids where known."""
  common = {'architectures': [families.FAMILIES[family]], 'vocab_size': decoder.vocab_size,
            'tie_word_embeddings': decoder.tied_embeddings, 'torch_dtype': dtype, **special}
  if family == 'gpt':
    return {**common, 'model_type': 'gpt2', 'n_embd': decoder.width,
            'n_layer': decoder.num_layers, 'n_head': decoder.num_heads,
            'n_inner': decoder.mlp_dim, 'n_positions': decoder.learned_positions,
            'n_ctx': decoder.learned_positions, 'layer_norm_epsilon': decoder.norm_eps,
            'activation_function': 'gelu_new', 'resid_pdrop': 0.0, 'embd_pdrop': 0.0,
            'attn_pdrop': 0.0}
  scaling = None
  if cfg.rope_scaling.kind == 'llama3':
    s = cfg.rope_scaling
    scaling = {'rope_type': 'llama3', 'factor': s.factor, 'low_freq_factor': s.low_freq_factor,
               'high_freq_factor': s.high_freq_factor,
               'original_max_position_embeddings': s.original_max_len}
  elif cfg.rope_scaling.kind == 'linear':
    scaling = {'rope_type': 'linear', 'factor': cfg.rope_scaling.factor}
  extra = ({'use_sliding_window': False} if family in ('qwen2', 'qwen3', 'qwen3_moe') else
           {'sliding_window': decoder.sliding_window or None}
           if family in ('mistral', 'mixtral') else {})
  if family == 'mixtral':
    extra.update(num_local_experts=decoder.num_experts,
                 num_experts_per_tok=decoder.experts_per_token,
                 router_aux_loss_coef=decoder.router_aux_weight,
                 output_router_logits=decoder.router_aux_weight > 0)
  elif family == 'qwen3_moe':
    extra.update(num_experts=decoder.num_experts, num_experts_per_tok=decoder.experts_per_token,
                 moe_intermediate_size=decoder.mlp_dim, norm_topk_prob=decoder.moe_norm_topk,
                 decoder_sparse_step=1, mlp_only_layers=[],
                 router_aux_loss_coef=decoder.router_aux_weight,
                 output_router_logits=decoder.router_aux_weight > 0)
  config = {**common, **extra, 'model_type': family, 'hidden_size': decoder.width,
            'num_hidden_layers': decoder.num_layers, 'num_attention_heads': decoder.num_heads,
            'num_key_value_heads': decoder.num_kv_heads, 'head_dim': decoder.head_dim,
            'intermediate_size': decoder.mlp_dim, 'rms_norm_eps': decoder.norm_eps,
            'rope_theta': cfg.rope_theta, 'rope_scaling': scaling, 'hidden_act': 'silu',
            'attention_bias': False, 'mlp_bias': False,
            'max_position_embeddings': cfg.max_seq_len or 2048}
  if family == 'qwen2':  # its query, key and value biases are not a setting
    del config['attention_bias']
  if family in families.GEMMA:
    del config['hidden_act'], config['mlp_bias']
    if family == 'gemma3' or scaling is None:  # Gemma 3's is in rope_parameters, global layers'
      del config['rope_scaling']
    types = gemma_config.layer_types(cfg.sliding_window_pattern, decoder.sliding_window,
                                     decoder.num_layers)
    config.update(model_type=families.GEMMA_TYPES[family],
                  hidden_activation='gelu_pytorch_tanh',
                  query_pre_attn_scalar=int(cfg.query_pre_attn_scalar or decoder.head_dim),
                  # transformers' Gemma needs one; no layer uses it when all are full_attention
                  sliding_window=decoder.sliding_window or config['max_position_embeddings'],
                  layer_types=types,
                  attn_logit_softcapping=cfg.attn_softcap or None,
                  final_logit_softcapping=cfg.final_softcap or None)
    if family == 'gemma3':
      del config['rope_theta']
      full = {'rope_type': 'default', 'rope_theta': cfg.rope_theta, **(scaling or {})}
      # Windowed layers rotate as the global ones (scaling included) unless the decoder built
      # them a base of their own: local_rope_theta=0, or every layer alike (pattern 0).
      local = full if decoder.local_rope is None else {'rope_type': 'default',
                                                       'rope_theta': cfg.local_rope_theta}
      config['rope_parameters'] = {'full_attention': full, 'sliding_attention': dict(local)}
  return config

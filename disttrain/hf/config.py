"""config.json of Hugging Face models: read, checked against the run's model fields, and turned
into them (model.name='hf'). The families and their defaults are hf/families.py's; Gemma's own
parts hf/gemma_config.py's. A field that differs from the run's config is one line naming both
values and the flag that fixes it.
"""

import dataclasses
import json
import os

import numpy as np

from disttrain.config import Config, ModelConfig, RopeScalingConfig
from disttrain.errors import CheckpointError, ConfigError
from disttrain.hf import gemma_config
from disttrain.hf.families import (ARCHITECTURES, FAMILIES, FIXED, GEMMA, MODEL_TYPES, MOE,
                                   mismatch, resolved, window)
from disttrain.models.decoder import DecoderConfig


def read(directory: str) -> tuple[dict, str]:
  """(config.json, family) of a Hugging Face model directory, checked to be one we map."""
  path = os.path.join(directory, 'config.json')
  try:
    with open(path, encoding='utf-8') as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f'{path} cannot be read ({e}); pass a Hugging Face model directory '
                          '(config.json + *.safetensors)') from e
  archs, kind = config.get('architectures') or [], config.get('model_type')
  family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if not archs and kind in MODEL_TYPES.values():  # AutoModelForCausalLM goes by model_type
    family = next(f for f, t in MODEL_TYPES.items() if t == kind)
  if family is None:
    raise CheckpointError(f'{path}: architectures {archs}' + (f' (model_type {kind!r})' if kind
                                                              else '') +
                          f' are none of {sorted(ARCHITECTURES)}, the Hugging Face models '
                          'disttrain maps; use one of them')
  if kind is not None and kind != MODEL_TYPES[family]:  # transformers would build another model
    raise CheckpointError(f'{path}: model_type {kind!r} is not a {FAMILIES[family]}\'s '
                          f'({MODEL_TYPES[family]!r}); fix config.json')
  try:
    _hf_values(config, family)
  except KeyError as e:  # a key transformers' config class has no default for here
    raise CheckpointError(f'{path} has no {e.args[0]!r}, which a {FAMILIES[family]} needs; add '
                          "it from the model's published config.json") from None
  return config, family


def _hf_values(config: dict, family: str) -> dict:
  """Our resolved decoder fields -> (config.json key, its value, or Hugging Face's default)."""
  if family != 'gpt':
    heads = config['num_attention_heads']
    head_dim = config.get('head_dim') or (128 if family == 'qwen3' else 256 if family in GEMMA
                                          else config['hidden_size'] // heads)
    moe = {}
    if family in MOE:
      mlp = 'moe_intermediate_size' if family == 'qwen3_moe' else 'intermediate_size'
      # Qwen3-MoE's published key is num_experts; transformers 5 saves num_local_experts.
      experts = next((k for k in ('num_local_experts', 'num_experts') if k in config),
                     'num_local_experts')
      qwen = family == 'qwen3_moe'  # else Mixtral: transformers' defaults, 8 experts, 2 a token
      moe = {'mlp_dim': (mlp, config[mlp]),
             'num_experts': (experts, config.get(experts, 128 if qwen else 8)),
             'experts_per_token': ('num_experts_per_tok',
                                   config.get('num_experts_per_tok', 8 if qwen else 2)),
             'moe_norm_topk': ('norm_topk_prob', config.get('norm_topk_prob', False)) if qwen
                              else ('norm_topk_prob (always, in Mixtral)', True)}
    return {'width': ('hidden_size', config['hidden_size']),
            'head_dim': ('head_dim', head_dim),
            'sliding_window': ('sliding_window', window(config, family)),
            'num_layers': ('num_hidden_layers', config['num_hidden_layers']),
            'num_heads': ('num_attention_heads', heads),
            'num_kv_heads': ('num_key_value_heads', config.get('num_key_value_heads') or heads),
            'mlp_dim': ('intermediate_size', config['intermediate_size']),
            'vocab_size': ('vocab_size', config['vocab_size']),
            'norm_eps': ('rms_norm_eps', resolved(config, family, 'rms_norm_eps', 1e-6)),
            'tied_embeddings': ('tie_word_embeddings',
                                config.get('tie_word_embeddings', family in GEMMA)),
            **moe}
  return {'width': ('n_embd', config['n_embd']), 'num_layers': ('n_layer', config['n_layer']),
          'num_heads': ('n_head', config['n_head']),
          'mlp_dim': ('n_inner', config.get('n_inner') or 4 * config['n_embd']),
          'vocab_size': ('vocab_size', config['vocab_size']),
          'norm_eps': ('layer_norm_epsilon', config.get('layer_norm_epsilon', 1e-5)),
          'tied_embeddings': ('tie_word_embeddings', config.get('tie_word_embeddings', True)),
          'learned_positions': ('n_positions', config['n_positions'])}


# Our decoder field -> the config field users set.
_FIELD = {'width': 'model.hidden', 'num_layers': 'model.num_layers',
          'num_heads': 'model.num_heads', 'num_kv_heads': 'model.num_kv_heads',
          'mlp_dim': 'model.mlp_dim', 'vocab_size': 'model.vocab_size',
          'norm_eps': 'model.norm_eps', 'tied_embeddings': 'model.tied_embeddings',
          'learned_positions': 'model.max_seq_len', 'head_dim': 'model.head_dim',
          'sliding_window': 'model.sliding_window', 'num_experts': 'model.num_experts',
          'experts_per_token': 'model.experts_per_token', 'moe_norm_topk': 'model.moe_norm_topk'}


def check(directory: str, family: str, cfg: ModelConfig, decoder: DecoderConfig) -> dict:
  """config.json against the run's model; returns it. A difference is one line naming both."""
  config, hf_family = read(directory)
  if hf_family != family:
    raise CheckpointError(f'restore_from={directory!r} is a {FAMILIES[hf_family]} but '
                          f'model.name={cfg.name!r}; set --config.model.name={hf_family}')
  for field, (hf_field, hf_value) in _hf_values(config, family).items():
    value = getattr(decoder, field)
    if not (np.isclose(value, hf_value, rtol=1e-6, atol=0) if isinstance(value, float)
            else value == hf_value):
      raise mismatch(directory, hf_field, hf_value, _FIELD[field], value)
  if family not in MOE and decoder.num_experts:
    raise CheckpointError(f'{directory}: config.json describes a dense {family} (no experts) but '
                          f'model.num_experts={decoder.num_experts}; set '
                          '--config.model.num_experts=0 (or restore a mixture-of-experts model)')
  if family != 'gpt':
    _check_rotary(directory, family, config, cfg)
  elif config.get('activation_function', 'gelu_new') not in ('gelu_new', 'gelu_pytorch_tanh'):
    raise CheckpointError(f'{directory}: activation_function={config["activation_function"]!r}; '
                          "the gpt family computes GELU's tanh form (gelu_new)")
  elif (not config.get('scale_attn_weights', True)
        or config.get('scale_attn_by_inverse_layer_idx', False)):
    raise CheckpointError(f'{directory}: config.json scale_attn_weights='
                          f'{config.get("scale_attn_weights", True)}, '
                          'scale_attn_by_inverse_layer_idx='
                          f'{config.get("scale_attn_by_inverse_layer_idx", False)}; the gpt family '
                          'scales attention by 1/sqrt(head size) only (True, False)')
  elif decoder.norm != 'layernorm':
    raise mismatch(directory, 'model_type', 'gpt2 (LayerNorm)', 'model.norm', decoder.norm)
  return config


def rope(config: dict, family: str) -> tuple[float, dict]:
  """(rope_theta, rope_scaling) of a config.json: the top-level keys published configs carry,
  or transformers 5's `rope_parameters` (theta and type together; type 'default' = no scaling;
  Gemma 3's per layer type: its global layers')."""
  params = config.get('rope_parameters')
  if isinstance(params, dict) and 'full_attention' in params:
    params = params['full_attention']
  if isinstance(params, dict) and 'rope_theta' in params:
    kind = params.get('rope_type', params.get('type', 'default'))
    return float(params['rope_theta']), (params if kind != 'default' else {})
  return float(resolved(config, family, 'rope_theta', 1e4)), config.get('rope_scaling') or {}


def _check_rotary(directory: str, family: str, config: dict, cfg: ModelConfig) -> None:
  for key, value in FIXED[family].items():
    if config.get(key, value) != value and not (value == [] and config[key] is None):
      raise CheckpointError(f'{directory}: config.json {key}={config[key]!r}; the {family} family '
                            f'has {key}={value!r}')
  local = (config.get('rope_parameters') or {}).get('sliding_attention') or {}
  if local.get('rope_type', 'default') != 'default' and not gemma_config.local_as_global(config):
    raise CheckpointError(f"{directory}: rope_parameters.sliding_attention rope_type "
                          f"{local['rope_type']!r}; the local layers rotate without scaling here")
  theta, scaling = rope(config, family)
  if not np.isclose(theta, cfg.rope_theta, rtol=1e-6):
    raise mismatch(directory, 'rope_theta', theta, 'model.rope_theta', cfg.rope_theta)
  kind = scaling.get('rope_type', scaling.get('type', '')) if scaling else ''
  if kind not in ('', 'default', 'llama3', 'linear'):
    raise CheckpointError(f'{directory}: rope_scaling type {kind!r} is not supported (llama3, '
                          'linear or none)')
  if family in GEMMA:
    gemma_config.check(directory, family, config, cfg)
  if kind == 'linear' and not (cfg.rope_scaling.kind == 'linear' and np.isclose(
      scaling['factor'], cfg.rope_scaling.factor)):
    raise mismatch(directory, 'rope_scaling', scaling, 'model.rope_scaling', vars(cfg.rope_scaling))
  if (kind == 'llama3') != (cfg.rope_scaling.kind == 'llama3') or (
      kind in ('', 'default') and cfg.rope_scaling.kind):
    raise mismatch(directory, 'rope_scaling.rope_type', kind if kind != 'default' else '',
                   'model.rope_scaling.kind', cfg.rope_scaling.kind)
  if kind == 'llama3':
    for hf_key, ours in (('factor', 'factor'), ('low_freq_factor', 'low_freq_factor'),
                         ('high_freq_factor', 'high_freq_factor'),
                         ('original_max_position_embeddings', 'original_max_len')):
      if not np.isclose(scaling[hf_key], getattr(cfg.rope_scaling, ours), rtol=1e-6):
        raise mismatch(directory, f'rope_scaling.{hf_key}', scaling[hf_key],
                       f'model.rope_scaling.{ours}', getattr(cfg.rope_scaling, ours))


# Model fields that shape training, not the model: a run's value wins over config.json's (the
# hf recipe sets them to -1 or '': config.json's, as transformers trains the model). The values
# are a dense model's, which has no router.
TRAINING_CHOICES = {'router_aux_weight': 0.0, 'router_z_weight': 0.0, 'expert_capacity': 0.0,
                    'router_balance': ModelConfig.router_balance}
_UNSET = (-1, '')  # launch/configs/hf.py's "the directory's"


def model_fields(config: dict, family: str) -> dict:
  """The model.* config fields that build the model a config.json describes."""
  values = {field: value for field, (_, value) in _hf_values(config, family).items()}
  fields = {'name': family, 'hidden': values['width'], 'num_layers': values['num_layers'],
            'num_heads': values['num_heads'], 'mlp_dim': values['mlp_dim'],
            'vocab_size': values['vocab_size'], 'norm_eps': float(values['norm_eps']),
            'tied_embeddings': bool(values['tied_embeddings']), 'dropout': 0.0}
  if family == 'gpt':
    return {**fields, 'max_seq_len': values['learned_positions'], 'norm': 'layernorm'}
  fields.update(num_kv_heads=values['num_kv_heads'], norm='rmsnorm', head_dim=values['head_dim'],
                sliding_window=values['sliding_window'],
                rope_theta=rope(config, family)[0],
                max_seq_len=int(config.get('max_position_embeddings', 0)))
  if family in GEMMA:
    fields.update(gemma_config.fields(config, family))
  if family in MOE:  # routed as transformers routes: every choice kept
    fields.update(num_experts=values['num_experts'],
                  experts_per_token=values['experts_per_token'],
                  moe_norm_topk=bool(values['moe_norm_topk']), expert_capacity=0.0,
                  # transformers adds the balancing loss only with output_router_logits
                  router_aux_weight=float(config.get('router_aux_loss_coef', 0.0))
                  if config.get('output_router_logits') else 0.0,
                  router_z_weight=0.0, router_balance='transformers')
  scaling = rope(config, family)[1]
  fields['rope_scaling'] = {}  # none: a run's own scaling is then a contradiction
  if scaling.get('rope_type', scaling.get('type')) == 'linear':
    fields['rope_scaling'] = {'kind': 'linear', 'factor': float(scaling['factor'])}
  if scaling.get('rope_type', scaling.get('type')) == 'llama3':
    fields['rope_scaling'] = {'kind': 'llama3', 'factor': float(scaling['factor']),
                              'low_freq_factor': float(scaling['low_freq_factor']),
                              'high_freq_factor': float(scaling['high_freq_factor']),
                              'original_max_len': int(scaling['original_max_position_embeddings'])}
  return fields


FROM_DIRECTORY = 'hf'  # model.name: the family and fields of restore_from's config.json
_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer.model')


def from_directory(cfg: Config) -> Config:
  """model.name='hf' (launch/configs/hf.py): the family and every model field from
  restore_from's config.json, as from_pretrained builds it. A field left at ModelConfig's default
  is taken; one set otherwise must agree (a contradiction is one line naming both). dropout, the
  expert capacity and the router loss weights are the run's (training choices), or config.json's
  where they are -1 (launch/configs/hf.py); data.tokenizer '' becomes the directory's tokenizer
  if it has one."""
  if cfg.model.name != FROM_DIRECTORY:
    return cfg
  directory = cfg.restore_from
  if not directory or not os.path.isfile(os.path.join(directory, 'config.json')):
    raise ConfigError(f"model.name='{FROM_DIRECTORY}' takes the model from restore_from's "
                      f'config.json, but restore_from={directory!r} is not a Hugging Face model '
                      'directory; set --config.restore_from=HF_DIR (config.json + *.safetensors)')
  config, family = read(directory)
  fields = model_fields(config, family)
  fields.pop('dropout')
  default, given = ModelConfig(), {}
  for name, dense in TRAINING_CHOICES.items():  # the run's own, or config.json's where unset
    value = fields.pop(name, dense)
    if getattr(cfg.model, name) in _UNSET:
      given[name] = value
  for name, value in fields.items():
    mine = getattr(cfg.model, name)
    if name == 'rope_scaling':
      value = RopeScalingConfig(**value)
    if mine != getattr(default, name) and mine != value and name != 'name':
      raise _contradiction(directory, name, value, mine)
    given[name] = value
  data = cfg.data
  if not data.tokenizer and any(os.path.isfile(os.path.join(directory, n))
                                for n in _TOKENIZER_FILES):
    data = dataclasses.replace(data, tokenizer=directory)
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **given), data=data)


def refuse_contradictions(cfg: Config, named: set[str]) -> None:
  """from_directory cannot tell a field set to ModelConfig's default from one left there (it
  takes config.json's): the fields a command line `named` must agree with config.json too. No
  directory yet (`disttrain check` of a recipe): the run's from_directory will say so."""
  if not named or not os.path.isfile(os.path.join(cfg.restore_from or '', 'config.json')):
    return
  resolved = from_directory(cfg).model
  for name in sorted(named - set(TRAINING_CHOICES) - {'dropout', 'name'}):
    mine, value = getattr(cfg.model, name, None), getattr(resolved, name, None)
    if mine != value:
      raise _contradiction(cfg.restore_from, name, value, mine)


def _contradiction(directory: str, name: str, value, mine) -> ConfigError:
  shown = vars(value) if name == 'rope_scaling' else value
  return ConfigError(f'{directory}: config.json gives model.{name}={shown!r} but the config '
                     f'sets model.{name}={mine!r}; drop --config.model.{name} (or set it to '
                     'that value)')

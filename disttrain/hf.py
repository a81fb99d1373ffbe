"""Hugging Face models in and out: the one place that knows their names, layouts and config.json.

`LlamaForCausalLM` is disttrain's llama family and `GPT2LMHeadModel` its gpt family
(disttrain/models/). Each of our parameters maps to one Hugging Face tensor (per layer for the
scanned blocks, stacked on our leading 'layers' axis): torch Linear weights are [out, in] and are
transposed, GPT-2's Conv1D weights are [in, out], heads are split out of the width, and our
vocabulary is padded to a multiple of 128 (padded rows are zeros in, dropped out). `load_params`
reads and places one tensor at a time onto its sharding, so host memory holds one tensor, not the
model; `export_tensors` yields them one at a time for disttrain/tensorfiles.py to write.
"""

import dataclasses
import json
import math
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from disttrain import sharding as sharding_lib
from disttrain import tensorfiles
from disttrain.config import ModelConfig
from disttrain.errors import CheckpointError, ConfigError
from disttrain.models.decoder import DecoderConfig

ARCHITECTURES = {'LlamaForCausalLM': 'llama', 'GPT2LMHeadModel': 'gpt'}
FAMILIES = {family: arch for arch, family in ARCHITECTURES.items()}
# Buffers some checkpoints carry that are not parameters (GPT-2's causal mask, RoPE tables).
_BUFFERS = ('.attn.bias', '.attn.masked_bias', '.rotary_emb.inv_freq')


@dataclasses.dataclass(frozen=True)
class Tensor:
  """How one of our parameters maps to a Hugging Face tensor.

  kind: 'linear' (torch [out, in]), 'conv1d' (GPT-2's [in, out]), 'flat' (the same values in
  another shape), 'embedding' ([V, D], rows padded), 'lm_head' (torch [V, D] of our [D, V]).
  n_in: how many of our leading dimensions are the layer's input (linear, conv1d).
  """
  ours: str
  hf: str  # '{i}' stands for the layer index of a scanned block weight
  kind: str = 'flat'
  n_in: int = 1

  def hf_shape(self, ours: tuple, vocab: int) -> tuple:
    if self.kind == 'embedding':
      return (vocab, ours[1])
    if self.kind == 'lm_head':
      return (vocab, ours[0])
    if self.kind in ('linear', 'conv1d'):
      io = (math.prod(ours[:self.n_in]), math.prod(ours[self.n_in:]))
      return io[::-1] if self.kind == 'linear' else io
    return (math.prod(ours),) if len(ours) > 1 and self.hf.endswith('bias') else ours

  def to_ours(self, x: np.ndarray, ours: tuple) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if self.kind == 'embedding':
      return np.pad(x, ((0, ours[0] - x.shape[0]), (0, 0)))
    if self.kind == 'lm_head':
      return np.pad(x.T, ((0, 0), (0, ours[1] - x.shape[0])))
    return (x.T if self.kind == 'linear' else x).reshape(ours)

  def to_hf(self, x: np.ndarray, vocab: int) -> np.ndarray:
    if self.kind == 'embedding':
      return x[:vocab]
    if self.kind == 'lm_head':
      return x[:, :vocab].T
    shape = self.hf_shape(x.shape, vocab)
    return x.reshape(shape[::-1]).T if self.kind == 'linear' else x.reshape(shape)


def _llama_table() -> list[Tensor]:
  layer = 'model.layers.{i}.'
  return [Tensor('embed', 'model.embed_tokens.weight', 'embedding'),
          Tensor('blocks/attention_norm/scale', layer + 'input_layernorm.weight'),
          *(Tensor(f'blocks/attention/{ours}/kernel', f'{layer}self_attn.{hf}_proj.weight',
                   'linear') for ours, hf in (('query', 'q'), ('key', 'k'), ('value', 'v'))),
          Tensor('blocks/attention/out/kernel', layer + 'self_attn.o_proj.weight', 'linear', 2),
          Tensor('blocks/mlp_norm/scale', layer + 'post_attention_layernorm.weight'),
          *(Tensor(f'blocks/mlp/{name}/kernel', f'{layer}mlp.{name}_proj.weight', 'linear')
            for name in ('gate', 'up', 'down')),
          Tensor('final_norm/scale', 'model.norm.weight'),
          Tensor('unembed/kernel', 'lm_head.weight', 'lm_head')]


def _gpt2_table() -> list[Tensor]:
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
  return table


TABLES = {'llama': _llama_table(), 'gpt': _gpt2_table()}


def is_hf_dir(path: str) -> bool:
  """A Hugging Face model directory (config.json or *.safetensors), not an orbax checkpoint."""
  return os.path.isdir(path) and (os.path.isfile(os.path.join(path, 'config.json')) or any(
      n.endswith('.safetensors') for n in os.listdir(path)))


def restore(directory: str, model, cfg: ModelConfig, abstract_params):
  """`restore_from` a Hugging Face directory: config.json checked, then the weights placed."""
  family = getattr(model, 'family', '')
  if not family:
    raise ConfigError(f'restore_from={directory!r} is a Hugging Face model directory, which loads '
                      f"into model.name='llama' or 'gpt', not {cfg.name!r}")
  check_config(directory, family, cfg, model.cfg)
  return load_params(directory, family, model.cfg, abstract_params)


def read_config(directory: str) -> tuple[dict, str]:
  """(config.json, family) of a Hugging Face model directory, checked to be one we map."""
  path = os.path.join(directory, 'config.json')
  try:
    with open(path, encoding='utf-8') as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f'{path} cannot be read ({e}); pass a Hugging Face model directory '
                          '(config.json + *.safetensors)') from e
  archs = config.get('architectures') or []
  family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if family is None:
    raise CheckpointError(f'{path}: architectures {archs} are none of {sorted(ARCHITECTURES)}, '
                          'the Hugging Face models disttrain maps; use one of them')
  return config, family


def _hf_values(config: dict, family: str) -> dict:
  """Our resolved decoder fields -> (config.json key, its value, or Hugging Face's default)."""
  if family == 'llama':
    heads = config['num_attention_heads']
    return {'width': ('hidden_size', config['hidden_size']),
            'num_layers': ('num_hidden_layers', config['num_hidden_layers']),
            'num_heads': ('num_attention_heads', heads),
            'num_kv_heads': ('num_key_value_heads', config.get('num_key_value_heads') or heads),
            'mlp_dim': ('intermediate_size', config['intermediate_size']),
            'vocab_size': ('vocab_size', config['vocab_size']),
            'norm_eps': ('rms_norm_eps', config.get('rms_norm_eps', 1e-6)),
            'tied_embeddings': ('tie_word_embeddings', config.get('tie_word_embeddings', False))}
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
          'learned_positions': 'model.max_seq_len'}


def _mismatch(where: str, hf_field: str, hf_value, ours: str, value) -> CheckpointError:
  return CheckpointError(f'{where}: config.json {hf_field}={hf_value!r} but {ours}={value!r}; set '
                         f'--config.{ours}={hf_value!r} (or use a config of that model)')


def check_config(directory: str, family: str, cfg: ModelConfig, decoder: DecoderConfig) -> dict:
  """config.json against the run's model; returns it. A difference is one line naming both."""
  config, hf_family = read_config(directory)
  if hf_family != family:
    raise CheckpointError(f'restore_from={directory!r} is a {FAMILIES[hf_family]} but '
                          f'model.name={cfg.name!r}; set --config.model.name={hf_family}')
  for field, (hf_field, hf_value) in _hf_values(config, family).items():
    value = getattr(decoder, field)
    if not (np.isclose(value, hf_value, rtol=1e-6, atol=0) if isinstance(value, float)
            else value == hf_value):
      raise _mismatch(directory, hf_field, hf_value, _FIELD[field], value)
  if family == 'llama':
    _check_llama(directory, config, cfg, decoder)
  elif config.get('activation_function', 'gelu_new') not in ('gelu_new', 'gelu_pytorch_tanh'):
    raise CheckpointError(f'{directory}: activation_function={config["activation_function"]!r}; '
                          "the gpt family computes GELU's tanh form (gelu_new)")
  elif decoder.norm != 'layernorm':
    raise _mismatch(directory, 'model_type', 'gpt2 (LayerNorm)', 'model.norm', decoder.norm)
  return config


def _check_llama(directory: str, config: dict, cfg: ModelConfig, decoder: DecoderConfig) -> None:
  fixed = {'hidden_act': 'silu', 'attention_bias': False, 'mlp_bias': False}
  for key, value in fixed.items():
    if config.get(key, value) != value:
      raise CheckpointError(f'{directory}: config.json {key}={config[key]!r}; the llama family '
                            f'has {key}={value!r}')
  head_dim = config.get('head_dim') or decoder.head_dim
  if head_dim != decoder.head_dim:
    raise CheckpointError(f'{directory}: config.json head_dim={head_dim} differs from '
                          f'hidden_size / num_attention_heads = {decoder.head_dim}, which the '
                          'llama family assumes')
  if not np.isclose(config.get('rope_theta', 10000.0), cfg.rope_theta, rtol=1e-6):
    raise _mismatch(directory, 'rope_theta', config.get('rope_theta', 10000.0),
                    'model.rope_theta', cfg.rope_theta)
  scaling = config.get('rope_scaling') or {}
  kind = scaling.get('rope_type', scaling.get('type', '')) if scaling else ''
  if kind not in ('', 'default', 'llama3'):
    raise CheckpointError(f'{directory}: rope_scaling type {kind!r} is not supported (llama3 or '
                          'none)')
  if (kind == 'llama3') != (cfg.rope_scaling.kind == 'llama3'):
    raise _mismatch(directory, 'rope_scaling.rope_type', kind or None, 'model.rope_scaling.kind',
                    cfg.rope_scaling.kind)
  if kind == 'llama3':
    for hf_key, ours in (('factor', 'factor'), ('low_freq_factor', 'low_freq_factor'),
                         ('high_freq_factor', 'high_freq_factor'),
                         ('original_max_position_embeddings', 'original_max_len')):
      if not np.isclose(scaling[hf_key], getattr(cfg.rope_scaling, ours), rtol=1e-6):
        raise _mismatch(directory, f'rope_scaling.{hf_key}', scaling[hf_key],
                        f'model.rope_scaling.{ours}', getattr(cfg.rope_scaling, ours))


def model_fields(config: dict, family: str) -> dict:
  """The model.* config fields that build the model a config.json describes."""
  values = {field: value for field, (_, value) in _hf_values(config, family).items()}
  fields = {'name': family, 'hidden': values['width'], 'num_layers': values['num_layers'],
            'num_heads': values['num_heads'], 'mlp_dim': values['mlp_dim'],
            'vocab_size': values['vocab_size'], 'norm_eps': float(values['norm_eps']),
            'tied_embeddings': bool(values['tied_embeddings']), 'dropout': 0.0}
  if family == 'gpt':
    return {**fields, 'max_seq_len': values['learned_positions'], 'norm': 'layernorm'}
  fields.update(num_kv_heads=values['num_kv_heads'], norm='rmsnorm',
                rope_theta=float(config.get('rope_theta', 10000.0)),
                max_seq_len=int(config.get('max_position_embeddings', 0)))
  scaling = config.get('rope_scaling') or {}
  if scaling.get('rope_type', scaling.get('type')) == 'llama3':
    fields['rope_scaling'] = {'kind': 'llama3', 'factor': float(scaling['factor']),
                              'low_freq_factor': float(scaling['low_freq_factor']),
                              'high_freq_factor': float(scaling['high_freq_factor']),
                              'original_max_len': int(scaling['original_max_position_embeddings'])}
  return fields


def _entries(family: str, params) -> list[tuple[Tensor, str, jax.ShapeDtypeStruct]]:
  """(map entry, our path, our leaf) for every parameter, in the table's order."""
  flat = {sharding_lib.path_str(p): leaf
          for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  table = {t.ours: t for t in TABLES[family]}
  unknown = sorted(set(flat) - set(table))
  if unknown:
    raise ConfigError(f'parameter {unknown[0]} has no Hugging Face name in the {family} map')
  return [(t, t.ours, flat[t.ours]) for t in TABLES[family] if t.ours in flat]


def load_params(directory: str, family: str, decoder: DecoderConfig, abstract_params):
  """Params (jax.Arrays on the shardings of `abstract_params`) from a Hugging Face directory."""
  reader = tensorfiles.Reader(directory)
  names = set(reader.names())
  prefixed = family == 'gpt' and not any(n.startswith('transformer.') for n in names)
  used, leaves = set(), {}
  for entry, path, leaf in _entries(family, abstract_params):
    layered = '{i}' in entry.hf
    shape = leaf.shape[1:] if layered else leaf.shape
    layer_sharding = leaf.sharding
    if layered:
      spec = tuple(leaf.sharding.spec) + (None,) * (len(leaf.shape) - len(leaf.sharding.spec))
      layer_sharding = NamedSharding(leaf.sharding.mesh, P(*spec[1:]))
    pieces = []
    for i in range(leaf.shape[0] if layered else 1):
      name = entry.hf.format(i=i)
      name = name.removeprefix('transformer.') if prefixed else name
      if name not in names:
        raise CheckpointError(f'{directory} has no tensor {name} (for {path} {tuple(shape)}); '
                              'the weights do not match config.json, re-export them')
      expected = entry.hf_shape(tuple(shape), decoder.vocab_size)
      if reader.shape(name) != expected:
        raise CheckpointError(f'{directory}: tensor {name} has shape {reader.shape(name)} but the '
                              f'config expects {expected}; use the config of that model')
      value = entry.to_ours(reader.read(name), tuple(shape))
      pieces.append(jax.make_array_from_callback(value.shape, layer_sharding,
                                                 lambda index, v=value: v[index]))
      used.add(name)
    leaves[path] = (jax.jit(lambda *xs: jnp.stack(xs), out_shardings=leaf.sharding)(*pieces)
                    if layered else pieces[0])
  extra = sorted(n for n in names - used if not n.endswith(_BUFFERS))
  if extra:
    raise CheckpointError(f'{directory} has tensor {extra[0]} that the config has no parameter '
                          f'for (e.g. an untied lm_head with model.tied_embeddings=True); use the '
                          'config of that model')
  flat = jax.tree_util.tree_flatten_with_path(abstract_params)
  return jax.tree_util.tree_unflatten(
      flat[1], [leaves[sharding_lib.path_str(p)] for p, _ in flat[0]])


def export_tensors(family: str, decoder: DecoderConfig, params,
                   dtype) -> Iterator[tuple[str, tuple, np.dtype, object]]:
  """(Hugging Face name, shape, dtype, produce) per tensor; each produce() fetches one layer."""
  for entry, _, leaf in _entries(family, params):
    layered = '{i}' in entry.hf
    shape = entry.hf_shape(tuple(leaf.shape[1:] if layered else leaf.shape), decoder.vocab_size)
    for i in range(leaf.shape[0] if layered else 1):
      produce = (lambda leaf=leaf, i=i, e=entry, layered=layered: e.to_hf(
          np.asarray(leaf[i] if layered else leaf), decoder.vocab_size))
      yield entry.hf.format(i=i), shape, dtype, produce


def hf_config(family: str, cfg: ModelConfig, decoder: DecoderConfig, dtype: str,
              special: dict) -> dict:
  """config.json of the exported model; `special`: bos/eos token ids where known."""
  common = {'architectures': [FAMILIES[family]], 'vocab_size': decoder.vocab_size,
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
  return {**common, 'model_type': 'llama', 'hidden_size': decoder.width,
          'num_hidden_layers': decoder.num_layers, 'num_attention_heads': decoder.num_heads,
          'num_key_value_heads': decoder.num_kv_heads, 'head_dim': decoder.head_dim,
          'intermediate_size': decoder.mlp_dim, 'rms_norm_eps': decoder.norm_eps,
          'rope_theta': cfg.rope_theta, 'rope_scaling': scaling, 'hidden_act': 'silu',
          'attention_bias': False, 'mlp_bias': False,
          'max_position_embeddings': cfg.max_seq_len or 2048}

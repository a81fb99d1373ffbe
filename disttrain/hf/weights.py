"""Hugging Face weights in and out: the one place that knows their tensor names and layouts.

`LlamaForCausalLM` is disttrain's llama family, `Qwen2ForCausalLM` and `Qwen3ForCausalLM` its
qwen2 and qwen3 families, `MistralForCausalLM` its mistral family (Llama's names),
`MixtralForCausalLM` and `Qwen3MoeForCausalLM` its mixtral and qwen3_moe families (a router and
one tensor per expert per layer), `GPT2LMHeadModel` its gpt family (disttrain/models/). Each of
our parameters maps to one Hugging Face tensor (per layer for the scanned blocks, stacked on our
leading 'layers' axis, and per expert on the next): torch
Linear weights are [out, in] and are transposed, GPT-2's Conv1D weights are [in, out], heads are
split out of the width, and our vocabulary is padded to a multiple of 128 (padded rows are zeros
in, dropped out). `load_params` reads and places one tensor at a time onto its sharding, so host
memory holds one tensor, not the model; `export_tensors` yields them one at a time for
disttrain/hf/tensorfiles.py to write.
config.json is read, checked and written by disttrain/hf/config.py.
"""

import dataclasses
import math
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from disttrain.config import ModelConfig
from disttrain.errors import CheckpointError, ConfigError
from disttrain.hf import config as hf_config, tensorfiles
from disttrain.models.decoder import DecoderConfig
from disttrain.parallel import sharding as sharding_lib

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


# MoE families: (the block's module, its experts' names for our gate, up and down).
_EXPERTS = {'mixtral': ('block_sparse_moe', ('w1', 'w3', 'w2')),
            'qwen3_moe': ('mlp', ('gate_proj', 'up_proj', 'down_proj'))}


def _llama_table(qkv_bias: bool = False, qk_norm: bool = False,
                 experts: str = '') -> list[Tensor]:
  """Llama's names; Qwen2 adds the query, key and value biases, Qwen3 the per-head norms; a MoE
  family's router and experts ('{j}': the expert) replace the MLP."""
  layer = 'model.layers.{i}.'
  mlp = [Tensor(f'blocks/mlp/{name}/kernel', f'{layer}mlp.{name}_proj.weight', 'linear')
         for name in ('gate', 'up', 'down')]
  if experts:
    module, names = _EXPERTS[experts]
    mlp = [Tensor('blocks/moe/router/kernel', f'{layer}{module}.gate.weight', 'linear'),
           *(Tensor(f'blocks/moe/{ours}', f'{layer}{module}.experts.{{j}}.{hf}.weight', 'linear')
             for ours, hf in zip(('gate', 'up', 'down'), names))]
  projections = (('query', 'q'), ('key', 'k'), ('value', 'v'))
  extra = [Tensor(f'blocks/attention/{ours}/bias', f'{layer}self_attn.{hf}_proj.bias')
           for ours, hf in projections if qkv_bias]
  extra += [Tensor(f'blocks/attention/{ours}_norm/scale', f'{layer}self_attn.{hf}_norm.weight')
            for ours, hf in projections[:2] if qk_norm]
  return [Tensor('embed', 'model.embed_tokens.weight', 'embedding'),
          *extra,
          Tensor('blocks/attention_norm/scale', layer + 'input_layernorm.weight'),
          *(Tensor(f'blocks/attention/{ours}/kernel', f'{layer}self_attn.{hf}_proj.weight',
                   'linear') for ours, hf in (('query', 'q'), ('key', 'k'), ('value', 'v'))),
          Tensor('blocks/attention/out/kernel', layer + 'self_attn.o_proj.weight', 'linear', 2),
          Tensor('blocks/mlp_norm/scale', layer + 'post_attention_layernorm.weight'),
          *mlp,
          Tensor('final_norm/scale', 'model.norm.weight'),
          Tensor('unembed/kernel', 'lm_head.weight', 'lm_head')]


def _gemma_table(qk_norm: bool) -> list[Tensor]:
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


TABLES = {'llama': _llama_table(), 'qwen2': _llama_table(qkv_bias=True),
          'qwen3': _llama_table(qk_norm=True), 'mistral': _llama_table(), 'gpt': _gpt2_table(),
          'mixtral': _llama_table(experts='mixtral'),
          'qwen3_moe': _llama_table(qk_norm=True, experts='qwen3_moe'),
          'gemma2': _gemma_table(qk_norm=False), 'gemma3': _gemma_table(qk_norm=True)}


def _lead(entry: Tensor) -> int:
  """Our leading axes that index Hugging Face tensors: layers ('{i}'), then experts ('{j}')."""
  return ('{i}' in entry.hf) + ('{j}' in entry.hf)


def is_hf_dir(path: str) -> bool:
  """A Hugging Face model directory (config.json or *.safetensors), not an orbax checkpoint."""
  return os.path.isdir(path) and (os.path.isfile(os.path.join(path, 'config.json')) or any(
      n.endswith('.safetensors') for n in os.listdir(path)))


def restore(directory: str, model, cfg: ModelConfig, abstract_params):
  """`restore_from` a Hugging Face directory: config.json checked, then the weights placed."""
  family = getattr(model, 'family', '')
  if not family:
    raise ConfigError(f'restore_from={directory!r} is a Hugging Face model directory, which loads '
                      f'into model.name in {sorted(TABLES)}, not {cfg.name!r}')
  hf_config.check(directory, family, cfg, model.cfg)
  return load_params(directory, family, model.cfg, abstract_params)


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
    lead = _lead(entry)
    shape = leaf.shape[lead:]
    spec = tuple(leaf.sharding.spec) + (None,) * (len(leaf.shape) - len(leaf.sharding.spec))
    piece_sharding = NamedSharding(leaf.sharding.mesh, P(*spec[lead:]))
    pieces = []
    for index in np.ndindex(leaf.shape[:lead]):
      name = entry.hf.format(i=index[0] if lead else 0, j=index[1] if lead > 1 else 0)
      name = name.removeprefix('transformer.') if prefixed else name
      if name not in names:
        raise CheckpointError(f'{directory} has no tensor {name} (for {path} {tuple(shape)}); '
                              'the weights do not match config.json, re-export them')
      expected = entry.hf_shape(tuple(shape), decoder.vocab_size)
      if reader.shape(name) != expected:
        raise CheckpointError(f'{directory}: tensor {name} has shape {reader.shape(name)} but the '
                              f'config expects {expected}; use the config of that model')
      value = entry.to_ours(reader.read(name), tuple(shape))
      pieces.append(jax.make_array_from_callback(value.shape, piece_sharding,
                                                 lambda index, v=value: v[index]))
      used.add(name)
    leaves[path] = (jax.jit(lambda *xs: jnp.stack(xs).reshape(leaf.shape),
                            out_shardings=leaf.sharding)(*pieces) if lead else pieces[0])
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
  """(Hugging Face name, shape, dtype, produce) per tensor; each produce(fetch=np.asarray)
  fetches one layer."""
  for entry, _, leaf in _entries(family, params):
    lead = _lead(entry)
    shape = entry.hf_shape(tuple(leaf.shape[lead:]), decoder.vocab_size)
    for index in np.ndindex(leaf.shape[:lead]):
      produce = (lambda fetch=np.asarray, leaf=leaf, index=index, e=entry: e.to_hf(
          fetch(leaf[index] if index else leaf), decoder.vocab_size))
      yield (entry.hf.format(i=index[0] if index else 0, j=index[1] if len(index) > 1 else 0),
             shape, dtype, produce)

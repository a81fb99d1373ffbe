"""Hugging Face weights in and out, one tensor at a time, for every family here.

Each family's module names its parameters' Hugging Face tensors (HF_NAMES, with the layouts of
disttrain/models/hf_names.py); this module is the generic machinery. Each of our parameters maps
to one Hugging Face tensor per layer of the scanned blocks (stacked on our leading 'layers' axis)
and per expert (on the next): torch Linear weights are [out, in] and are transposed, GPT-2's
Conv1D weights are [in, out], heads are split out of the width, and our vocabulary is padded to a
multiple of 128 (padded rows are zeros in, dropped out). `load_params` reads and places one
tensor at a time onto its sharding, so host memory holds one tensor, not the model;
`export_tensors` yields them one at a time for disttrain/hf/tensorfiles.py to write. config.json
is read and checked by disttrain/hf/config.py, written by disttrain/hf/exported_config.py.
"""

import os
from collections.abc import Iterator

import jax
import numpy as np

from disttrain import models
from disttrain.config import ModelConfig
from disttrain.errors import CheckpointError, ConfigError
from disttrain.hf import config as hf_config, tensorfiles
from disttrain.models.decoder import DecoderConfig
from disttrain.models.hf_names import Tensor
from disttrain.parallel import sharding as sharding_lib

# Buffers some checkpoints carry that are not parameters (GPT-2's causal mask, RoPE tables).
_BUFFERS = ('.attn.bias', '.attn.masked_bias', '.rotary_emb.inv_freq')


# family -> its parameters' Hugging Face names (each family's module owns its map).
TABLES = models.HF_NAMES


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
    shape = tuple(leaf.shape[lead:])
    expected = entry.hf_shape(shape, decoder.vocab_size)
    hf_names = {}  # index over the stacked (layer, expert) axes -> its tensor
    for index in np.ndindex(leaf.shape[:lead]):
      name = entry.hf.format(i=index[0] if lead else 0, j=index[1] if lead > 1 else 0)
      name = name.removeprefix('transformer.') if prefixed else name
      if name not in names:
        fused = next((n for n in sorted(names) if '.experts.gate_up_proj' in n), None)
        raise CheckpointError(
            f'{directory} has no tensor {name} (for {path} {shape}); ' + (
                f"it holds transformers' fused expert tensors ({fused}), a layout disttrain "
                'does not read: save the model again with save_pretrained(save_original_format='
                'True), one tensor per expert' if fused else
                'the weights do not match config.json, re-export them'))
      if reader.shape(name) != expected:
        raise CheckpointError(f'{directory}: tensor {name} has shape {reader.shape(name)} but the '
                              f'config expects {expected}; use the config of that model')
      hf_names[index] = name
    used.update(hf_names.values())
    leaves[path] = _placed(reader, entry, hf_names, leaf, lead, shape)
  extra = sorted(n for n in names - used if not n.endswith(_BUFFERS)
                 # a tied model's head is the embedding, whatever else a save wrote for it
                 and not (decoder.tied_embeddings and n.endswith('lm_head.weight')))
  if extra:
    raise CheckpointError(f'{directory} has tensor {extra[0]} that the config has no parameter '
                          f'for (e.g. an untied lm_head with model.tied_embeddings=True); use the '
                          'config of that model')
  flat = jax.tree_util.tree_flatten_with_path(abstract_params)
  return jax.tree_util.tree_unflatten(
      flat[1], [leaves[sharding_lib.path_str(p)] for p, _ in flat[0]])


def _placed(reader, entry: Tensor, hf_names: dict, leaf, lead: int, shape: tuple) -> jax.Array:
  """The leaf on its sharding, each tensor converted once into the blocks of the devices that
  hold part of it: a layer- or expert-split leaf is never whole on one device."""
  where = leaf.sharding.addressable_devices_indices_map(leaf.shape)
  key = lambda index: tuple(s.indices(n) for s, n in zip(index, leaf.shape))
  blocks = {key(index): (index, np.empty([len(range(*k)) for k in key(index)], np.float32))
            for index in where.values()}  # one per distinct block: replicas share it
  for at, name in hf_names.items():
    value = entry.to_ours(reader.read(name), shape)
    for index, block in blocks.values():
      stacked = [range(*s.indices(n)) for s, n in zip(index[:lead], leaf.shape[:lead])]
      if all(a in r for a, r in zip(at, stacked)):
        block[tuple(r.index(a) for a, r in zip(at, stacked))] = value[index[lead:]]
  return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, [
      jax.device_put(blocks[key(index)][1], device) for device, index in where.items()])


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

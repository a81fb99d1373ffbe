"""Partition rules -> PartitionSpecs for parameters, state and batches.

Order of precedence for each parameter: a matching `param_rules` regex, else its Flax
logical-axis names mapped through `logical_rules`; then, with `sharding='fsdp'`, the largest
still-unsharded dimension divisible by the fsdp axis is split over 'fsdp'.
"""

import contextlib
import contextvars
import math
import re
from typing import Any

import jax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from disttrain.config import Config
from disttrain.errors import ShardingError
from disttrain.parallel.mesh import Parallelism


def path_str(path) -> str:
  """'Dense_0/kernel' for a pytree key path."""
  parts = []
  for key in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return '/'.join(parts)


def spec_axes(spec: tuple) -> list[str]:
  """The mesh axes a PartitionSpec (or spec tuple) names, in order."""
  return [n for e in spec for n in (e if isinstance(e, tuple) else (e,)) if n is not None]


def _axis_size(mesh: Mesh, entry) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names if n is not None)


def _check_spec(path: str, shape: tuple[int, ...], spec: tuple, mesh: Mesh, origin: str) -> None:
  if len(spec) != len(shape):
    raise ShardingError(f'{origin} gives {path} (shape {shape}) a spec of {len(spec)} dims '
                        f'{spec}; give one entry per dimension')
  for dim, entry in zip(shape, spec):
    for name in (entry if isinstance(entry, tuple) else (entry,)):
      if name is not None and name not in mesh.shape:
        raise ShardingError(f'{origin} names mesh axis {name!r}, missing from mesh '
                            f'{dict(mesh.shape)}; use one of {tuple(mesh.shape)}')
    if dim % _axis_size(mesh, entry):
      raise ShardingError(f'{origin}: {path} dim {dim} of shape {shape} is not divisible by '
                          f'{entry}={_axis_size(mesh, entry)}; change the rule or the mesh')
  named = spec_axes(spec)
  twice = next((n for n in named if named.count(n) > 1), None)
  if twice is not None:
    raise ShardingError(f'{origin} gives {path} (shape {shape}) the spec {spec}, which names mesh '
                        f'axis {twice!r} twice; an axis splits one dimension, use it once')


# Logical axes split only where the mesh axis divides them, else kept whole (and listed): a
# model's K/V head count is often below the tensor axis (grouped-query attention).
WHEN_DIVISIBLE = ('kv_heads',)


def _rule_spec(path: str, shape, logical: P | None, cfg: Config, mesh: Mesh,
               whole: list) -> tuple:
  for pattern, spec in cfg.param_rules:
    if re.search(pattern, path):
      spec = tuple(tuple(e) if isinstance(e, list) else e for e in spec)
      _check_spec(path, shape, spec, mesh, f'param_rules {pattern!r}')
      return spec
  if logical is not None and len(logical) == len(shape):
    mapping = Parallelism(mesh).activation_rules(cfg.logical_rules)
    spec = []
    for name, dim in zip(logical, shape):
      axis = mapping.get(name) if isinstance(name, str) else None
      if name in WHEN_DIVISIBLE and axis is not None and dim % _axis_size(mesh, axis):
        whole.append(f'{path} {shape}: {name}={dim} is not divisible by {axis}='
                     f'{_axis_size(mesh, axis)}, kept whole')
        axis = None
      if axis is not None and set(spec_axes((axis,))) & set(spec_axes(spec)):
        # flax's logical_to_mesh_axes: an axis a dimension before took is not used again
        whole.append(f'{path} {shape}: {name} maps to {axis}, which an earlier dimension '
                     'splits, kept whole')
        axis = None
      spec.append(axis)
    spec = tuple(spec)
    _check_spec(path, shape, spec, mesh, f'logical_rules for {tuple(logical)}')
    return spec
  return (None,) * len(shape)


def _add_fsdp(path, shape, spec, axis: str, fsdp: int, min_size: int, replicated: list) -> tuple:
  """Splits the largest free dimension divisible by `fsdp` over `axis`; records why when it
  cannot."""
  if axis in spec_axes(spec):
    replicated.append(f'{path} {shape}: already split over fsdp by a rule')
    return spec
  if math.prod(shape) < min_size:
    replicated.append(f'{path} {shape}: {math.prod(shape)} < fsdp_min_size={min_size}')
    return spec
  free = [i for i, e in enumerate(spec) if e is None and shape[i] % fsdp == 0]
  if not free:
    replicated.append(f'{path} {shape}: no free dimension divisible by fsdp={fsdp}')
    return spec
  dim = max(free, key=lambda i: shape[i])
  return spec[:dim] + (axis,) + spec[dim + 1:]


def specs_for(tree: Any, cfg: Config, mesh: Mesh, logical: Any = None,
              prefix: str = '') -> tuple[Any, list[str]]:
  """PartitionSpecs for every leaf of `tree` (arrays or ShapeDtypeStructs) and what stayed whole
  (fsdp's small or indivisible leaves, WHEN_DIVISIBLE axes the mesh does not divide)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  logical_leaves = ([None] * len(leaves) if logical is None else
                    jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P) or x is None))
  if len(logical_leaves) != len(leaves):
    logical_leaves = [None] * len(leaves)
  parallel = Parallelism(mesh)
  fsdp = parallel.fsdp if cfg.sharding == 'fsdp' else 1
  replicated, specs = [], []
  for (path, leaf), names in zip(leaves, logical_leaves):
    name = prefix + path_str(path)
    spec = _rule_spec(name, tuple(leaf.shape), names, cfg, mesh, replicated)
    if fsdp > 1:
      spec = _add_fsdp(name, tuple(leaf.shape), spec, parallel.fsdp_axis, fsdp,
                       cfg.fsdp_min_size, replicated)
    specs.append(P(*spec))
  return jax.tree_util.tree_unflatten(treedef, specs), replicated


def log_replicated(replicated: list[str]) -> None:
  """Says which parameters fsdp left whole, and why (so memory surprises are explained)."""
  for line in replicated:
    logging.info('fsdp: replicated %s', line)


def named(mesh: Mesh, specs: Any) -> Any:
  """NamedSharding tree for a PartitionSpec tree."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def spec_lists(specs: Any) -> dict[str, list]:
  """{'Dense_0/kernel': ['fsdp', None], ...}: the JSON form written to run.json."""
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
  return {path_str(path): [list(e) if isinstance(e, tuple) else e for e in spec]
          for path, spec in flat}


def split_summary(specs: Any, mesh: Mesh) -> dict:
  """What the layout does to the parameters, whatever field asked for it (sharding=fsdp,
  logical or param rules): the mesh axes (of size > 1) that split some parameter, and how many
  of the parameter arrays are split. run.json's 'param_split'; the console's start line."""
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  axes, split, leaves = set(), 0, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  for spec in leaves:
    used = {a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))
            if sizes.get(a, 1) > 1}
    axes |= used
    split += bool(used)
  return {'axes': [a for a in mesh.axis_names if a in axes], 'split': split,
          'arrays': len(leaves)}


def describe_split(summary: dict) -> str:
  """'params split over fsdp, tensor (12 of 14 arrays)' or 'params replicated'."""
  if not summary['split']:
    return 'params replicated'
  return (f"params split over {', '.join(summary['axes'])} ({summary['split']} of "
          f"{summary['arrays']} arrays)")


_ACTIVATIONS = contextvars.ContextVar('disttrain_activation_rules', default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, logical_rules: tuple, micro_batches: int = 1):
  """While a jit-style step is traced: `constrain` maps activations' logical axes to mesh axes
  (Parallelism.activation_rules); a pipelined model splits the batch into `micro_batches`."""
  parallel = Parallelism(mesh)
  token = _ACTIVATIONS.set((mesh, parallel.activation_rules(logical_rules), micro_batches))
  try:
    yield
  finally:
    _ACTIVATIONS.reset(token)


def pipeline_split() -> tuple[Mesh, str, tuple, int] | None:
  """(mesh, stage axis, batch axes, micro-batches) while a jit-style step is traced on a mesh
  with pipeline stages, else None: a stack of layers then runs as disttrain/models/pipeline.py."""
  context = _ACTIVATIONS.get()
  if context is None or Parallelism(context[0]).stages == 1:
    return None
  return context[0], Parallelism.stage_axis, Parallelism.batch_axes, context[2]


def sequence_split() -> tuple[Mesh, str] | None:
  """(mesh, axis) while a jit-style step is traced on a mesh that splits positions, else None:
  attention then gathers keys and values over that axis."""
  context = _ACTIVATIONS.get()
  if context is None or Parallelism(context[0]).context == 1:
    return None
  return context[0], Parallelism.sequence_axis


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """x split as its logical axes say under activation_rules; unchanged anywhere else (outside
  a jit-style step, inside shard_map), so models can call it unconditionally."""
  context = _ACTIVATIONS.get()
  if context is None:
    return x
  mesh, rules, _ = context
  used, spec = set(), []
  for name, dim in zip(logical_axes, x.shape):
    entry = rules.get(name) if name is not None else None
    axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                 if a is not None and a not in used and mesh.shape[a] > 1)
    if dim % math.prod(mesh.shape[a] for a in axes):
      axes = ()  # a hint, not a layout: a dimension the axes do not divide stays whole
    used.update(axes)
    spec.append(axes if len(axes) > 1 else (axes[0] if axes else None))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

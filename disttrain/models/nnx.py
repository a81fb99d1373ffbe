"""Flax NNX adapter: an `nnx.Module` behind the functional protocol of disttrain/models/linen.py.

The module is built by `make(rngs, input_shape)` and taken apart with `nnx.split` into
  params       nnx.Param                       -> TrainState.params (a plain nested dict)
  batch_stats  nnx.BatchStat                   -> TrainState.mutable['batch_stats']
  state        other Variables (not RNG state) -> TrainState.mutable['state']
  RNG state    RngKey / RngCount               -> not stored: rebuilt for every call
Dropout keys come from the step's rng (each RNG stream of the module gets fold_in(rng, i)), so
they follow the step's rules (layout-independent under jit) and no key lives in the state.
`module.train()` / `module.eval()` pick the mode. Parameter sharding metadata (`out_sharding`,
set by `nnx.with_partitioning` or `nnx.Param(..., out_sharding=...)`) gives the logical specs.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from disttrain.errors import ConfigError
from disttrain.models.linen import InputKey, model_inputs

# Variable type per TrainState collection; whatever is neither a parameter nor RNG state nor a
# batch statistic lands in 'state' (e.g. a user's own nnx.Variable subclass).
_COLLECTIONS = (('params', nnx.Param), ('batch_stats', nnx.BatchStat), ('rng', nnx.RngState),
                ('state', ...))


@dataclasses.dataclass(frozen=True)
class NNXModel:
  """Wraps `make(rngs: nnx.Rngs, input_shape: tuple) -> nnx.Module`, called as `module(x)`.

  `input_shape` is one example's shape (no batch axis), for modules that need their input width;
  with a tuple of input keys, a tuple of such shapes, and the module is called `module(x, y, ..)`.
  """
  make: Callable[[nnx.Rngs, tuple], nnx.Module]
  input_key: InputKey = 'image'
  batch_axes: Any = None  # set by with_batch_axes: BatchNorm statistics reduce over these axes
  # input shape -> (graphdef, abstract states per collection); eval_shape once per shape.
  _structure: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def _build(self, rng: jax.Array, input_shape: tuple) -> nnx.Module:
    # Eager sharding would place each Variable on a mesh at creation; disttrain shards the whole
    # state afterwards (jit out_shardings), so creation must stay unsharded.
    with nnx.use_eager_sharding(False):
      return self.make(nnx.Rngs(rng), tuple(input_shape))

  def _split(self, input_shape: tuple):
    """The module's graphdef and abstract states, computed once per input shape."""
    if input_shape not in self._structure:
      abstract = nnx.eval_shape(lambda: self._build(jax.random.key(0), input_shape))
      graphdef, *states = nnx.split(abstract, *(f for _, f in _COLLECTIONS))
      self._structure[input_shape] = graphdef, dict(zip((n for n, _ in _COLLECTIONS), states))
    return self._structure[input_shape]

  def _input_shape(self, inputs: tuple) -> tuple:
    shapes = tuple(tuple(x.shape[1:]) for x in inputs)
    return shapes[0] if isinstance(self.input_key, str) else shapes

  def init(self, rng: jax.Array, batch: dict) -> dict:
    """{'params', 'batch_stats', 'state'} as plain dicts; empty collections left out."""
    inputs = model_inputs(batch, self.input_key)
    variables = _collections(self._build(rng, self._input_shape(inputs)))
    return {k: v for k, v in variables.items() if k == 'params' or jax.tree.leaves(v)}

  def apply(self, variables: dict, batch: dict, *, train: bool, rng: jax.Array | None):
    """(outputs, new batch_stats/state, 0.0): merge, set the mode, call, split again."""
    inputs = model_inputs(batch, self.input_key)
    graphdef, abstract = self._split(self._input_shape(inputs))
    states = []
    for name, _ in _COLLECTIONS:
      # A copy of the abstract state filled with this call's values (replace_by_pure_dict
      # mutates, and the cached abstract state must stay free of tracers).
      state = jax.tree.map(lambda leaf: leaf, abstract[name])
      values = _rng_values(state, rng) if name == 'rng' else variables.get(name, {})
      if jax.tree.leaves(state):
        nnx.replace_by_pure_dict(state, values)
      states.append(state)
    module = nnx.merge(graphdef, *states)
    if self.batch_axes is not None:
      for _, sub in nnx.iter_modules(module):
        if hasattr(sub, 'axis_name'):
          sub.axis_name = self.batch_axes
    if train:
      module.train()
    else:
      module.eval()
    outputs = module(*inputs)
    if not train:
      return outputs, {}, jnp.float32(0.0)
    new = {k: v for k, v in _collections(module).items() if k in variables and k != 'params'}
    return outputs, new, jnp.float32(0.0)

  def logical_specs(self, batch: dict) -> dict:
    """{'params': PartitionSpecs} from each nnx.Param's sharding metadata (P() where absent)."""
    _, abstract = self._split(self._input_shape(model_inputs(batch, self.input_key)))
    return {'params': nnx.to_pure_dict(nnx.get_partition_spec(abstract['params']))}

  def with_batch_axes(self, axes) -> 'NNXModel':
    """For shard_map/pmap: modules with an `axis_name` (BatchNorm) reduce over `axes`."""
    return dataclasses.replace(self, batch_axes=axes, _structure=self._structure)

  def check_batch_axes(self, variables: dict) -> None:
    """Refuses per-device statistics: every module owning mutable Variables needs axis_name."""
    del variables  # the module itself says which submodules own mutable state
    if not self._structure:  # not initialised yet: nothing known, so nothing can be allowed
      raise ConfigError('NNXModel.check_batch_axes before init; build the state first')
    graphdef, abstract = next(iter(self._structure.values()))
    module = nnx.merge(graphdef, *abstract.values())
    owners = dict(nnx.iter_modules(module))
    for name in ('batch_stats', 'state'):
      for path, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract[name]))[0]:
        keys = tuple(getattr(k, 'key', getattr(k, 'idx', k)) for k in path)
        owner = owners.get(keys[:-1])
        if owner is not None and not hasattr(owner, 'axis_name'):
          where = '/'.join(map(str, keys[:-1])) or 'the top level'
          raise ConfigError(
              f'{type(owner).__name__} at {where} has mutable state {keys[-1]!r} but no '
              'axis_name, so shard_map/pmap would compute per-device statistics; give it an '
              'axis_name attribute or use step_mode=jit')


def _collections(module: nnx.Module) -> dict:
  """The module's Variables as plain dicts per collection, without RNG state."""
  _, *states = nnx.split(module, *(f for _, f in _COLLECTIONS))
  variables = {name: nnx.to_pure_dict(state) for (name, _), state in zip(_COLLECTIONS, states)}
  del variables['rng']
  return variables


def _rng_values(rng_state, rng: jax.Array | None) -> dict:
  """RNG stream values for one call: key i = fold_in(rng, i), counts 0."""
  base = jax.random.key(0) if rng is None else rng  # eval: dropout is off, any key will do
  pure = nnx.to_pure_dict(rng_state)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
  values = []
  for i, (path, leaf) in enumerate(leaves):
    is_key = getattr(path[-1], 'key', None) == 'key'
    values.append(jax.random.fold_in(base, i) if is_key else jnp.zeros(leaf.shape, leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, values)

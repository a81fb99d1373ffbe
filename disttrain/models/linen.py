"""Flax Linen adapter: init/apply with params, mutable collections (batch_stats) and rngs.

The protocol every front end follows:
  init(rng, batch) -> variables                       {'params': ..., <mutable collections>}
      (batch: a one-example batch of zeros with the data's fields, dtypes and shapes)
  apply(variables, batch, *, train, rng) -> (outputs, new mutable collections, model_loss)
      model_loss: a scalar added to the global-mean data loss (e.g. Keras add_loss terms, which
      are means over the examples the call saw); 0.0 when the model has none
  logical_specs(batch of ShapeDtypeStructs) -> PartitionSpecs of logical axis names, or None
  with_batch_axes(axes) -> model whose cross-example statistics reduce over `axes`
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from disttrain.errors import ConfigError, DataError

InputKey = str | tuple[str, ...]
# A Linen module's model losses: `self.sow('losses', name, value)` with scalar means over the
# examples of the call (e.g. a router's load-balancing loss); the adapter sums them every call.
LOSSES = 'losses'


def model_inputs(batch: dict, input_key: InputKey) -> tuple:
  """The model's positional inputs: batch[key] for one key, one per key for a tuple of keys."""
  keys = (input_key,) if isinstance(input_key, str) else tuple(input_key)
  missing = [k for k in keys if k not in batch]
  if missing:
    fields = sorted(k for k in batch if not k.startswith('_'))
    raise DataError(f'the model reads batch field {missing[0]!r}, but the data has {fields}; set '
                    "the model's input_key (config: model.input_key) to one of them")
  return tuple(batch[k] for k in keys)



@dataclasses.dataclass(frozen=True)
class LinenModel:
  """Wraps a Linen module called as `module(batch[input_key], train=...)`.

  `input_key` may be a tuple of fields, passed as positional arguments in that order. Values the
  module sows into the 'losses' collection are its model loss (their sum), not state.
  """
  module: nn.Module
  input_key: InputKey = 'image'

  def inputs(self, batch: dict) -> tuple[tuple, dict]:
    """The module's positional and keyword inputs from a batch."""
    return model_inputs(batch, self.input_key), {}

  def init(self, rng: jax.Array, batch: dict) -> dict:
    params_rng, dropout_rng = jax.random.split(rng)
    args, kwargs = self.inputs(batch)
    variables = dict(nn.unbox(self.module.init({'params': params_rng, 'dropout': dropout_rng},
                                               *args, train=False, **kwargs)))
    variables.pop(LOSSES, None)  # values of one call, not state
    return variables

  def apply(self, variables: dict, batch: dict, *, train: bool, rng: jax.Array | None,
            sown: tuple[str, ...] = ()):
    """(outputs, new mutable collections, model loss); `sown` collections (values of this call
    that a subclass reads) are returned with the new collections, whether training or not."""
    mutable = [name for name in variables if name != 'params'] if train else []
    rngs = {'dropout': rng} if rng is not None else {}
    args, kwargs = self.inputs(batch)
    outputs, new_mutable = self.module.apply(variables, *args, train=train, rngs=rngs,
                                             mutable=[*mutable, LOSSES, *sown], **kwargs)
    new_mutable = dict(new_mutable)
    losses = jax.tree.leaves(new_mutable.pop(LOSSES, {}))
    model_loss = sum((jnp.sum(jnp.asarray(l, jnp.float32)) for l in losses), jnp.float32(0.0))
    values = {name: new_mutable.pop(name) for name in sown if name in new_mutable}
    return outputs, {**(new_mutable if train else {}), **values}, model_loss

  def logical_specs(self, batch: dict) -> Any:
    """Logical axis names from `nn.with_logical_partitioning` metadata (None where absent).

    `batch` may hold arrays or jax.ShapeDtypeStructs (shapes are all that is traced).
    """
    def init(b):
      args, kwargs = self.inputs(b)
      return self.module.init({'params': jax.random.key(0), 'dropout': jax.random.key(0)}, *args,
                              train=False, **kwargs)
    specs = dict(nn.get_partition_spec(jax.eval_shape(init, batch)))
    specs.pop(LOSSES, None)
    return specs

  def with_batch_axes(self, axes) -> 'LinenModel':
    """For shard_map/pmap: BatchNorm statistics must reduce over the batch axes, not one device."""
    fields = {f.name for f in dataclasses.fields(self.module)}
    if 'axis_name' in fields:
      return dataclasses.replace(self, module=self.module.clone(axis_name=axes))
    return self

  def check_batch_axes(self, variables: dict) -> None:
    """Refuses per-device statistics: mutable collections need an `axis_name` field."""
    fields = {f.name for f in dataclasses.fields(self.module)}
    if set(variables) - {'params'} and 'axis_name' not in fields:
      raise ConfigError(
          f'{type(self.module).__name__} has mutable collections '
          f'{sorted(set(variables) - {"params"})} '
          'but no axis_name field, so shard_map/pmap would compute per-device statistics; add '
          'axis_name (passed to BatchNorm) or use step_mode=jit')

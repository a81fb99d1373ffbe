"""Flax Linen adapter: init/apply with params, mutable collections (batch_stats) and rngs.

The protocol every front end follows:
  init(rng, batch) -> variables                       {'params': ..., <mutable collections>}
  apply(variables, batch, *, train, rng) -> (outputs, new mutable collections, model_loss)
      model_loss: a scalar added to the global-mean data loss (e.g. Keras add_loss terms, which
      are means over the examples the call saw); 0.0 when the model has none
  logical_specs(abstract variables) -> PartitionSpecs of logical axis names, or None
  with_batch_axes(axes) -> model whose cross-example statistics reduce over `axes`
"""

import dataclasses
from typing import Any

import jax
from flax import linen as nn

from disttrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LinenModel:
  """Wraps a Linen module called as `module(batch[input_key], train=...)`."""
  module: nn.Module
  input_key: str = 'image'

  def init(self, rng: jax.Array, batch: dict) -> dict:
    params_rng, dropout_rng = jax.random.split(rng)
    variables = self.module.init({'params': params_rng, 'dropout': dropout_rng},
                                 batch[self.input_key], train=False)
    return nn.unbox(variables)

  def apply(self, variables: dict, batch: dict, *, train: bool, rng: jax.Array | None):
    mutable = [name for name in variables if name != 'params'] if train else False
    rngs = {'dropout': rng} if rng is not None else {}
    out = self.module.apply(variables, batch[self.input_key], train=train, rngs=rngs,
                            mutable=mutable)
    outputs, new_mutable = out if train else (out, {})
    return outputs, new_mutable, 0.0

  def logical_specs(self, batch: dict) -> Any:
    """Logical axis names from `nn.with_logical_partitioning` metadata (None where absent)."""
    boxed = jax.eval_shape(
        lambda: self.module.init({'params': jax.random.key(0), 'dropout': jax.random.key(0)},
                                 batch[self.input_key], train=False))
    return nn.get_partition_spec(boxed)

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
          f'{type(self.module).__name__} has mutable collections {sorted(set(variables) - {"params"})} '
          'but no axis_name field, so shard_map/pmap would compute per-device statistics; add '
          'axis_name (passed to BatchNorm) or use step_mode=jit')

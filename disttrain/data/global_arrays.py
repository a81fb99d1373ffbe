"""A process's rows of a global batch -> global jax.Arrays: which rows of the batch this process's
devices hold (its shards of the batch axis), and the Assembler that puts them on the devices as
one jax.Array per field (one device_put on one process, make_array_from_process_local_data or
per-device pieces on several). K stacked batches [K, B, ...] keep the batch axis split.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from disttrain.errors import DataError

Batch = dict[str, jax.Array]


def local_rows(sharding: NamedSharding, global_batch_size: int) -> np.ndarray:
  """Sorted rows of the global batch held by this process's addressable devices."""
  try:
    index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  except ValueError as e:  # IndivisibleError: the batch does not split evenly over the shards
    shards = sharding.num_devices // _replicas(sharding)
    raise DataError(f'batch size {global_batch_size} does not split over the {shards} batch '
                    f'shards of the mesh; use a batch size that is a multiple of {shards}') from e
  held = np.zeros(global_batch_size, dtype=bool)
  for index in index_map.values():
    held[index[0]] = True
  return np.flatnonzero(held)


def _replicas(sharding: NamedSharding) -> int:
  """How many devices hold each row: the mesh axes the batch axis is not split over."""
  spec = sharding.spec[0] if len(sharding.spec) else None
  axes = spec if isinstance(spec, tuple) else (spec,)
  split = int(np.prod([sharding.mesh.shape[a] for a in axes if a is not None]))
  return sharding.num_devices // split


class Assembler:
  """Turns this process's rows of a batch (numpy) into global jax.Arrays with one sharding."""

  def __init__(self, sharding: NamedSharding, global_batch_size: int):
    """Precomputes which local rows go to which addressable device."""
    self.sharding = sharding
    self.batch_size = global_batch_size
    self.rows = local_rows(sharding, global_batch_size)
    # make_array_from_process_local_data maps the process's data onto its devices in row order;
    # that is exactly our layout when the rows are one block. Otherwise place per-device pieces.
    self.contiguous = bool(self.rows.size == 0 or
                           self.rows[-1] - self.rows[0] + 1 == self.rows.size)
    self.pieces = []  # (device, start, stop) into the local rows
    for device, index in sharding.addressable_devices_indices_map((global_batch_size,)).items():
      start, stop, _ = index[0].indices(global_batch_size)
      lo = int(np.searchsorted(self.rows, start))
      self.pieces.append((device, lo, lo + stop - start))

  def __call__(self, local: dict[str, np.ndarray], piecewise: bool = False,
               batch_axis: int = 0, copy: bool = False) -> Batch:
    """Global arrays whose `batch_axis` is the global batch (1 for [K, B, ...] stacked batches).

    piecewise forces the per-device path; copy: the arrays are someone else's buffers (a worker's
    shared memory), which device arrays must not alias.
    """
    if copy:
      local = {k: np.array(v, copy=True) for k, v in local.items()}
    for key, value in local.items():
      if value.shape[batch_axis] != self.rows.size:
        raise DataError(f'batch field {key!r} has {value.shape[batch_axis]} local rows, expected '
                        f'{self.rows.size}; the pipeline read rows for another sharding')
    sharding = self.sharding if batch_axis == 0 else stacked_sharding(self.sharding, 2)
    if jax.process_count() == 1 and not piecewise:
      # This process holds the whole batch: one batched device_put, the cheapest host-to-device
      # path. may_alias: the arrays are fresh gathers nobody writes again, so the runtime may
      # use them in place (docs/performance.md).
      return jax.device_put(local, sharding, may_alias=True)
    shapes = {k: v.shape[:batch_axis] + (self.batch_size,) + v.shape[batch_axis + 1:]
              for k, v in local.items()}
    if self.contiguous and not piecewise:
      # One call for the whole dict.
      return jax.make_array_from_process_local_data(sharding, local, shapes)
    rows = lambda lo, hi: (slice(None),) * batch_axis + (slice(lo, hi),)
    return {k: jax.make_array_from_single_device_arrays(
        shapes[k], sharding,
        [jax.device_put(v[rows(lo, hi)], device) for device, lo, hi in self.pieces])
            for k, v in local.items()}


def stacked_sharding(sharding: NamedSharding, k: int) -> NamedSharding:
  """The sharding of K stacked batches [K, B, ...] (K > 1): the batch axis split as usual."""
  if k == 1:
    return sharding
  return NamedSharding(sharding.mesh, P(None, *sharding.spec))

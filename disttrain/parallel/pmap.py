"""Legacy pmap data parallelism over every device of the mesh (fsdp = tensor = 1).

pmap is jit(shard_map) in this JAX, so each step is one jitted call around the pmapped function
that splits the global batch into [n, B/n, ...] inside it (one dispatch per step instead of
three: split, pmap, metrics). The state is replicated with a leading device axis.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from disttrain.errors import ConfigError
from disttrain.parallel import step as step_lib
from disttrain.parallel.compiled import Steps
from disttrain.parallel.state import Layout, TrainState
from disttrain.parallel.step import StepContext, Variant


def build(ctx: StepContext, mesh: Mesh, lay: Layout, evaluate, batch_sharding: NamedSharding,
          global_batch_size: int) -> Steps:
  """Train steps of every Variant with steps == 1 (pmap has no steps_per_dispatch)."""
  devices = list(mesh.devices.flat)
  n = len(devices)
  local = StepContext(**{**ctx.__dict__, 'model': step_lib.with_batch_axes(
      ctx.model, 'batch', state_mutable=lay.shardings.mutable)})
  full_count = np.float32(global_batch_size) if step_lib.weighs_rows(ctx.task) else None
  traces = collections.Counter()
  # pmap returns arrays sharded over a mesh named after its axis; placing inputs on that same
  # mesh keeps the second call from compiling again.
  pmap_mesh = jax.make_mesh((n,), ('batch',), axis_types=(AxisType.Auto,), devices=devices)
  stacked = NamedSharding(pmap_mesh, P('batch'))
  split = lambda b: jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), b)
  first = lambda tree: jax.tree.map(lambda x: x[0], tree)

  def local_grads(state: TrainState, batch: dict, all_metrics: bool = True,
                  full_batch: bool = False):
    count = full_count if full_batch and full_count is not None else jax.lax.psum(
        step_lib.total_weight(ctx.task, batch), 'batch')
    grads, sums, new_mutable = step_lib.per_device_grads(
        local, state.params, state.mutable, batch, step_lib.dropout_key(state), count, 'batch', n,
        all_metrics)
    return grads, sums, count, new_mutable

  def make_train(variant: Variant):
    if variant.steps != 1:
      raise ConfigError(f'steps_per_dispatch={variant.steps} needs step_mode=jit or shard_map, '
                        'not pmap; use one of them or steps_per_dispatch=1')

    def local_step(state: TrainState, batch: dict):
      return step_lib.update(ctx.tx, state,
                             *local_grads(state, batch, variant.metrics, variant.full_batch),
                             variant.metrics, report_count=full_count is None)
    # Metrics are psums, equal on every device: unmapped outputs (out_axes None), so no
    # device-0 slice and no broadcast of it back to every device.
    pmapped = jax.pmap(local_step, axis_name='batch', devices=devices, out_axes=(0, None))

    def step(state, batch):
      traces[variant.name] += 1
      return pmapped(state, split(step_lib.with_mask(batch)))
    return jax.jit(step, in_shardings=(stacked, batch_sharding),
                   out_shardings=(stacked, NamedSharding(mesh, P())), donate_argnums=0)

  pmapped_grads = jax.pmap(lambda s, b: local_grads(s, b)[0], axis_name='batch', devices=devices)
  grads = jax.jit(lambda s, b: first(pmapped_grads(s, split(step_lib.with_mask(b)))),
                  in_shardings=(stacked, batch_sharding))
  place = jax.jit(lambda s: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), s),
                  out_shardings=stacked)
  export = jax.jit(first, out_shardings=lay.shardings)
  return Steps(make_train=make_train, evaluate=evaluate, grads=grads, place=place, export=export,
               traces=traces)

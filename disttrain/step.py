"""Pure train/eval steps and the three ways of running them on a mesh.

One computation, three thin styles:
  jit        GSPMD: the step is written for the global batch; XLA inserts the collectives.
  shard_map  each device computes loss x mask sums and gradients of its rows; explicit psum over
             the batch axes ('data', 'fsdp'); the optimizer update then runs sharded (GSPMD).
  pmap       legacy data parallelism: state replicated with a leading device axis.

Losses are sum(loss x mask) / global count, so every style gives the global-batch mean. Dropout
keys: jit uses fold_in(rng, step) for the whole global batch (GSPMD's partitionable threefry makes
the mask independent of the layout); shard_map and pmap use fold_in(fold_in(rng, step), d) with d
the device's linear index along the batch axes, so their masks depend on the layout.
"""

import collections
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from disttrain.config import BATCH_AXES, Config
from disttrain.errors import ConfigError
from disttrain.state import Layout, TrainState

Metrics = dict[str, jax.Array]


def _dropout_key(state: TrainState) -> jax.Array:
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


def _grads(model, task, params, mutable, batch, rng, count, model_loss_share=1.0,
           all_metrics=True):
  """Gradient of sum(loss x mask) / count + model loss, the masked sums, and new collections.

  `model_loss_share` is 1 / (number of devices the batch is split over) in shard_map/pmap, where
  each device's model loss (a mean over its rows) enters once per device and the psum averages.
  `all_metrics=False` sums only the loss (the task's other metrics are then never computed).
  `count` is the global number of valid examples: a cross-device sum of the mask, or in the quiet
  steps the static global batch size (see `Step`).
  """
  def loss_fn(params):
    outputs, new_mutable, model_loss = model.apply({'params': params, **mutable}, batch,
                                                   train=True, rng=rng)
    per_example = task.per_example(outputs, batch)
    if not all_metrics:
      per_example = {'loss': per_example['loss']}
    sums = {k: jnp.sum(v * batch['mask']) for k, v in per_example.items()}
    model_loss = model_loss * model_loss_share
    # Reported 'loss' includes the model loss (times count, since records divide by count).
    sums['loss'] = sums['loss'] + model_loss * count
    return sums['loss'] / count, (sums, new_mutable)
  (_, (sums, new_mutable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return grads, sums, new_mutable


def _update(tx, state: TrainState, grads, sums, count, new_mutable,
            all_metrics: bool = True) -> tuple[TrainState, Metrics]:
  """One optimizer step; metrics = sums / count, plus count and grad_norm if `all_metrics`.

  A global norm is one more pass over every gradient (measured 6-9 % of a small MLP's CPU step,
  and as a lax.cond on logged steps still ~4 %), so only the logged steps' variant computes it.
  """
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state, mutable=new_mutable)
  metrics = {k: v / count for k, v in sums.items()}
  if all_metrics:
    metrics.update(count=count, grad_norm=optax.tree.norm(grads))
  return new_state, metrics


@jax.jit
def params_finite(params: Any) -> jax.Array:
  """True if every parameter is finite: checked before each save."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


@dataclasses.dataclass(frozen=True)
class StepContext:
  """What a user-supplied train step gets: the framework's own pieces of the default step.

  The default step is `apply_gradients(state, *loss_and_grads(state, batch))`; a custom one
  (two optimizers, GAN-style alternation, ...) recombines these and keeps sharding, data,
  checkpoints and logging. It must return (new state, metrics) with a scalar 'loss'.
  """
  model: Any
  task: Any
  tx: optax.GradientTransformation

  def dropout_key(self, state: TrainState) -> jax.Array:
    """fold_in(rng, step): the same for every layout."""
    return _dropout_key(state)

  def loss_and_grads(self, state: TrainState, batch: dict, params: Any = None):
    """(grads, masked sums, global valid count, new mutable) of the global-batch mean loss."""
    count = jnp.sum(batch['mask'])
    grads, sums, new_mutable = _grads(self.model, self.task,
                                      state.params if params is None else params, state.mutable,
                                      batch, _dropout_key(state), count)
    return grads, sums, count, new_mutable

  def apply_gradients(self, state: TrainState, grads, sums, count, new_mutable):
    """One optimizer update with `tx`; metrics = sums / count, count, grad_norm."""
    return _update(self.tx, state, grads, sums, count, new_mutable)


@dataclasses.dataclass
class Step:
  """Compiled train/eval steps for one style, plus conversions to the style's state form.

  Variants of the train step, each compiled on first use:
  - `train` returns every metric (the task's, 'count', 'grad_norm') and normalises by the global
    count of valid rows, a sum of the mask over the batch: the one to call on any batch,
    padded or not.
  - The loop's variants are for full batches (every mask 1), which is what its train iterator
    yields: they normalise by the static global batch size, so no cross-device sum of the mask
    has to finish before the backward pass (measured ~7 % of the seed-000 MLP's step on 8 CPU
    devices). `train_logged` returns every metric and runs on the steps that end a train record;
    `train_quiet` returns only 'loss' and runs on the steps in between: no global norm (~7 % of
    that step on CPU, ~4 % even as a lax.cond) and no accuracy reductions (~2 %).
  """
  train: Callable[[Any, dict], tuple[Any, Metrics]]  # (device state, batch) -> (state, metrics)
  train_logged: Callable[[Any, dict], tuple[Any, Metrics]]  # full batches; every metric
  train_quiet: Callable[[Any, dict], tuple[Any, Metrics]]  # full batches; metrics: 'loss' only
  evaluate: Callable[[TrainState, dict], Metrics]  # (state, batch) -> sums incl. 'count'
  grads: Callable[[Any, dict], Any]  # (device state, batch) -> global-batch gradients
  # (state, K stacked full batches [K, B, ...]) -> (state, metrics): K steps in one compiled
  # call, as Keras' steps_per_execution. Metrics: 'loss' as [K]; train_many's other metrics are
  # scalars of its last step (which ends a record). None in pmap style.
  train_many: Callable[[Any, dict], tuple[Any, Metrics]] | None
  train_many_quiet: Callable[[Any, dict], tuple[Any, Metrics]] | None
  place: Callable[[TrainState], Any]  # canonical state -> the style's device state
  export: Callable[[Any], TrainState]  # the style's device state -> canonical state
  traces: collections.Counter  # variant -> how often it was traced (each must compile once)

  @property
  def trace_count(self) -> int:
    """The most traces of any one train variant: 1 when every variant used compiled once."""
    return max(self.traces.values(), default=0)

  def for_call(self, logged: bool, steps_per_call: int) -> Callable:
    """The loop's variant for one call (full batches): all metrics if it ends a train record."""
    if steps_per_call == 1:
      return self.train_logged if logged else self.train_quiet
    return self.train_many if logged else self.train_many_quiet


def build(model, task, tx: optax.GradientTransformation, cfg: Config, mesh: Mesh, lay: Layout,
          batch_sharding: NamedSharding, train_step: Callable | None = None) -> Step:
  """The train and eval steps of `cfg.step_mode`, jitted with shardings and donation.

  `train_step(ctx: StepContext, state, batch) -> (state, metrics)` replaces the default update
  (jit style only: it is written for the global batch); its metrics are reported every step.
  """
  traces = collections.Counter()
  replicated = NamedSharding(mesh, P())

  def eval_fn(state: TrainState, batch: dict) -> Metrics:
    outputs, _, model_loss = model.apply({'params': state.params, **state.mutable}, batch,
                                         train=False, rng=None)
    sums = {k: jnp.sum(v * batch['mask']) for k, v in task.per_example(outputs, batch).items()}
    sums['count'] = jnp.sum(batch['mask'])
    sums['loss'] = sums['loss'] + model_loss * sums['count']
    return sums

  evaluate = jax.jit(eval_fn, in_shardings=(lay.shardings, batch_sharding),
                     out_shardings=replicated)
  if cfg.step_mode == 'pmap':
    return _pmap_step(model, task, tx, mesh, lay, traces, evaluate, batch_sharding,
                      np.float32(cfg.global_batch_size))

  context = StepContext(model=model, task=task, tx=tx)
  full_count = np.float32(cfg.global_batch_size)  # a literal in the compiled step
  if cfg.step_mode == 'jit':
    def grads_fn(state: TrainState, batch: dict, all_metrics: bool = True,
                 full_batch: bool = False):
      count = full_count if full_batch else jnp.sum(batch['mask'])
      grads, sums, new_mutable = _grads(model, task, state.params, state.mutable, batch,
                                        _dropout_key(state), count, all_metrics=all_metrics)
      return grads, sums, count, new_mutable
  else:  # shard_map
    local_model = _with_batch_axes(model, BATCH_AXES, state_mutable=lay.shardings.mutable)
    batch_ways = mesh.shape['data'] * mesh.shape['fsdp']

    def local_grads(params, mutable, batch, key, all_metrics, full_batch):
      count = full_count if full_batch else jax.lax.psum(jnp.sum(batch['mask']), BATCH_AXES)
      key = jax.random.fold_in(key, jax.lax.axis_index(BATCH_AXES))
      grads, sums, new_mutable = _grads(local_model, task, params, mutable, batch, key, count,
                                        1.0 / batch_ways, all_metrics)
      # Each device holds d(its loss x mask sum / global count); their sum is the global gradient.
      return jax.lax.psum(grads, BATCH_AXES), jax.lax.psum(sums, BATCH_AXES), count, new_mutable

    def grads_fn(state: TrainState, batch: dict, all_metrics: bool = True,
                 full_batch: bool = False):
      # Parameters enter replicated (gathered from fsdp shards by XLA); check_vma=False because
      # the psums above are written out explicitly rather than implied by varying-axis types.
      sharded = jax.shard_map(functools.partial(local_grads, all_metrics=all_metrics,
                                                full_batch=full_batch), mesh=mesh,
                              in_specs=(P(), P(), P(BATCH_AXES), P()),
                              out_specs=(P(), P(), P(), P()), check_vma=False)
      return sharded(state.params, state.mutable, batch, _dropout_key(state))

  def one_step(state, batch, all_metrics=True, full_batch=False):
    return _update(tx, state, *grads_fn(state, batch, all_metrics, full_batch), all_metrics)

  if train_step is not None:
    if cfg.step_mode != 'jit':
      raise ConfigError(f'a custom train_step is written for the global batch and runs with '
                        f'step_mode=jit, not {cfg.step_mode}; pass --config.step_mode=jit')
    one_step = lambda state, batch, all_metrics=True, full_batch=False: _with_defaults(
        *train_step(context, state, batch), batch)

  def compiled(name: str, fn: Callable, many: bool) -> Callable:
    def counted(state, batch):
      traces[name] += 1
      return fn(state, batch)
    return jax.jit(counted, in_shardings=(lay.shardings, stacked if many else batch_sharding),
                   out_shardings=(lay.shardings, replicated), donate_argnums=0)

  def many(state, batches, all_metrics):
    quiet = lambda s, b: one_step(s, b, all_metrics=False, full_batch=True)
    if not all_metrics:
      return jax.lax.scan(quiet, state, batches)
    # K-1 quiet steps, then the step that ends the record with every metric.
    state, first = jax.lax.scan(quiet, state, jax.tree.map(lambda x: x[:-1], batches))
    state, last = one_step(state, jax.tree.map(lambda x: x[-1], batches), full_batch=True)
    metrics = dict(last)
    for key in first:
      metrics[key] = jnp.concatenate([first[key], last[key][None]])
    return state, metrics

  stacked = NamedSharding(mesh, P(None, BATCH_AXES))
  custom = train_step is not None  # one variant: the user's step reports what it reports
  train = compiled('train', one_step, many=False)
  train_many = compiled('train_many', functools.partial(many, all_metrics=True), many=True)
  grads = jax.jit(lambda state, batch: grads_fn(state, batch)[0],
                  in_shardings=(lay.shardings, batch_sharding), out_shardings=lay.shardings.params)
  return Step(
      train=train,
      train_logged=train if custom else compiled(
          'train_logged', functools.partial(one_step, full_batch=True), many=False),
      train_quiet=train if custom else compiled(
          'train_quiet', functools.partial(one_step, all_metrics=False, full_batch=True),
          many=False),
      evaluate=evaluate, grads=grads, train_many=train_many,
      train_many_quiet=train_many if custom else compiled(
          'train_many_quiet', functools.partial(many, all_metrics=False), many=True),
      place=lambda state: state, export=lambda state: state, traces=traces)


def _with_defaults(state: TrainState, metrics: Metrics, batch: dict):
  """A custom step's metrics, completed with what logging and the NaN guard read."""
  if 'loss' not in metrics:
    raise ConfigError(f'the custom train_step returned metrics {sorted(metrics)} without a '
                      "scalar 'loss'; return (state, {'loss': ..., ...})")
  metrics = dict(metrics)
  metrics.setdefault('count', jnp.sum(batch['mask']))
  return state, metrics


def _with_batch_axes(model, axes, state_mutable):
  """The model with cross-device BatchNorm statistics; refuses silent per-device statistics."""
  if jax.tree.leaves(state_mutable):
    model.check_batch_axes({'params': None, **{k: None for k in state_mutable}})
  return model.with_batch_axes(axes)


def _pmap_step(model, task, tx, mesh: Mesh, lay: Layout, traces: collections.Counter, evaluate,
               batch_sharding: NamedSharding, full_count: np.float32) -> Step:
  """Legacy pmap data parallelism over every device of the mesh (fsdp = tensor = 1).

  pmap is jit(shard_map) in this JAX, so each step is one jitted call around the pmapped
  function that splits the global batch into [n, B/n, ...] inside it (one dispatch per step
  instead of three: split, pmap, metrics).
  """
  devices = list(mesh.devices.flat)
  n = len(devices)
  local_model = _with_batch_axes(model, 'batch', state_mutable=lay.shardings.mutable)
  # pmap returns arrays sharded over a mesh named after its axis; placing inputs on that same
  # mesh keeps the second call from compiling again.
  pmap_mesh = jax.make_mesh((n,), ('batch',), axis_types=(AxisType.Auto,), devices=devices)
  stacked = NamedSharding(pmap_mesh, P('batch'))
  split = lambda b: jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), b)
  first = lambda tree: jax.tree.map(lambda x: x[0], tree)

  def local_grads(state: TrainState, batch: dict, all_metrics: bool = True,
                  full_batch: bool = False):
    count = full_count if full_batch else jax.lax.psum(jnp.sum(batch['mask']), 'batch')
    key = jax.random.fold_in(_dropout_key(state), jax.lax.axis_index('batch'))
    grads, sums, new_mutable = _grads(local_model, task, state.params, state.mutable, batch, key,
                                      count, 1.0 / n, all_metrics)
    return jax.lax.psum(grads, 'batch'), jax.lax.psum(sums, 'batch'), count, new_mutable

  def variant(name: str, all_metrics: bool, full_batch: bool) -> Callable:
    def local_step(state: TrainState, batch: dict):
      return _update(tx, state, *local_grads(state, batch, all_metrics, full_batch), all_metrics)
    # Metrics are psums, equal on every device: unmapped outputs (out_axes None), so no
    # device-0 slice and no broadcast of it back to every device.
    pmapped = jax.pmap(local_step, axis_name='batch', devices=devices, out_axes=(0, None))

    def step(state, batch):
      traces[name] += 1
      return pmapped(state, split(batch))
    return jax.jit(step, in_shardings=(stacked, batch_sharding),
                   out_shardings=(stacked, NamedSharding(mesh, P())), donate_argnums=0)

  pmapped_grads = jax.pmap(lambda s, b: local_grads(s, b)[0], axis_name='batch', devices=devices)
  grads = jax.jit(lambda s, b: first(pmapped_grads(s, split(b))),
                  in_shardings=(stacked, batch_sharding))
  place = jax.jit(lambda s: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), s),
                  out_shardings=stacked)
  export = jax.jit(first, out_shardings=lay.shardings)
  return Step(train=variant('train', True, False),
              train_logged=variant('train_logged', True, True),
              train_quiet=variant('train_quiet', False, True),
              evaluate=evaluate, grads=grads, train_many=None, train_many_quiet=None,
              place=place, export=export, traces=traces)

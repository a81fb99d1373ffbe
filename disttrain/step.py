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

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from disttrain.config import BATCH_AXES, Config
from disttrain.errors import ConfigError
from disttrain.state import Layout, TrainState

Metrics = dict[str, jax.Array]


def _dropout_key(state: TrainState) -> jax.Array:
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


def _grads(model, task, params, mutable, batch, rng, count, model_loss_share=1.0):
  """Gradient of sum(loss x mask) / count + model loss, the masked sums, and new collections.

  `model_loss_share` is 1 / (number of devices the batch is split over) in shard_map/pmap, where
  each device's model loss (a mean over its rows) enters once per device and the psum averages.
  """
  def loss_fn(params):
    outputs, new_mutable, model_loss = model.apply({'params': params, **mutable}, batch,
                                                   train=True, rng=rng)
    per_example = task.per_example(outputs, batch)
    sums = {k: jnp.sum(v * batch['mask']) for k, v in per_example.items()}
    model_loss = model_loss * model_loss_share
    # Reported 'loss' includes the model loss (times count, since records divide by count).
    sums['loss'] = sums['loss'] + model_loss * count
    return sums['loss'] / count, (sums, new_mutable)
  (_, (sums, new_mutable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return grads, sums, new_mutable


def _update(tx, state: TrainState, grads, sums, count, new_mutable,
            norm_wanted: Callable | None = None) -> tuple[TrainState, Metrics]:
  """One optimizer step. grad_norm is computed where `norm_wanted(step)` (default: always).

  A global norm is one more pass over every gradient: measured 6-9 % of a small MLP's step on
  CPU, so the default step computes it only for steps that are logged (0.0 elsewhere).
  """
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state, mutable=new_mutable)
  metrics = {k: v / count for k, v in sums.items()}
  if norm_wanted is None:
    grad_norm = optax.tree.norm(grads)
  else:
    grad_norm = jax.lax.cond(norm_wanted(new_state.step), optax.tree.norm,
                             lambda _: jnp.zeros((), jnp.float32), grads)
  metrics.update(count=count, grad_norm=grad_norm)
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
  """Compiled train/eval steps for one style, plus conversions to the style's state form."""
  train: Callable[[Any, dict], tuple[Any, Metrics]]  # (device state, batch) -> (state, metrics)
  evaluate: Callable[[TrainState, dict], Metrics]  # (state, batch) -> sums incl. 'count'
  grads: Callable[[Any, dict], Any]  # (device state, batch) -> global-batch gradients
  # (state, K stacked batches [K, B, ...]) -> (state, metrics [K]): K steps in one compiled call,
  # as Keras' steps_per_execution. None in pmap style.
  train_many: Callable[[Any, dict], tuple[Any, Metrics]] | None
  place: Callable[[TrainState], Any]  # canonical state -> the style's device state
  export: Callable[[Any], TrainState]  # the style's device state -> canonical state
  trace_count: list  # [n]: how often the train step was traced (it must compile once)


def build(model, task, tx: optax.GradientTransformation, cfg: Config, mesh: Mesh, lay: Layout,
          batch_sharding: NamedSharding, train_step: Callable | None = None) -> Step:
  """The train and eval steps of `cfg.step_mode`, jitted with shardings and donation.

  `train_step(ctx: StepContext, state, batch) -> (state, metrics)` replaces the default update
  (jit style only: it is written for the global batch).
  """
  traces = [0]
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
  identity = lambda state: state
  if cfg.step_mode == 'pmap':
    return _pmap_step(model, task, tx, mesh, lay, traces, evaluate, _logged_steps(cfg))

  context = StepContext(model=model, task=task, tx=tx)
  if cfg.step_mode == 'jit':
    grads_fn = context.loss_and_grads
  else:  # shard_map
    local_model = _with_batch_axes(model, BATCH_AXES, state_mutable=lay.shardings.mutable)
    batch_ways = mesh.shape['data'] * mesh.shape['fsdp']

    def local_grads(params, mutable, batch, key):
      count = jax.lax.psum(jnp.sum(batch['mask']), BATCH_AXES)
      key = jax.random.fold_in(key, jax.lax.axis_index(BATCH_AXES))
      grads, sums, new_mutable = _grads(local_model, task, params, mutable, batch, key, count,
                                        1.0 / batch_ways)
      # Each device holds d(its loss x mask sum / global count); their sum is the global gradient.
      return jax.lax.psum(grads, BATCH_AXES), jax.lax.psum(sums, BATCH_AXES), count, new_mutable

    # Parameters enter replicated (gathered from fsdp shards by XLA); check_vma=False because the
    # psums above are written out explicitly rather than implied by varying-axis types.
    sharded_grads = jax.shard_map(local_grads, mesh=mesh,
                                  in_specs=(P(), P(), P(BATCH_AXES), P()),
                                  out_specs=(P(), P(), P(), P()), check_vma=False)

    def grads_fn(state: TrainState, batch: dict):
      return sharded_grads(state.params, state.mutable, batch, _dropout_key(state))

  logged = _logged_steps(cfg)
  one_step = lambda state, batch: _update(tx, state, *grads_fn(state, batch), logged)
  if train_step is not None:
    if cfg.step_mode != 'jit':
      raise ConfigError(f'a custom train_step is written for the global batch and runs with '
                        f'step_mode=jit, not {cfg.step_mode}; pass --config.step_mode=jit')
    one_step = lambda state, batch: _with_defaults(*train_step(context, state, batch), batch)

  def train_fn(state: TrainState, batch: dict):
    traces[0] += 1
    return one_step(state, batch)

  def train_many_fn(state: TrainState, batches: dict):
    traces[0] += 1
    return jax.lax.scan(one_step, state, batches)

  train = jax.jit(train_fn, in_shardings=(lay.shardings, batch_sharding),
                  out_shardings=(lay.shardings, replicated), donate_argnums=0)
  stacked = NamedSharding(mesh, P(None, BATCH_AXES))
  train_many = jax.jit(train_many_fn, in_shardings=(lay.shardings, stacked),
                       out_shardings=(lay.shardings, replicated), donate_argnums=0)
  grads = jax.jit(lambda state, batch: grads_fn(state, batch)[0],
                  in_shardings=(lay.shardings, batch_sharding), out_shardings=lay.shardings.params)
  return Step(train=train, evaluate=evaluate, grads=grads, train_many=train_many, place=identity,
              export=identity, trace_count=traces)


def _logged_steps(cfg: Config) -> Callable[[jax.Array], jax.Array]:
  """Whether a step (1-based) ends a train record: the steps whose grad_norm is reported."""
  return lambda step: (step % cfg.log_every_steps == 0) | (step == cfg.num_train_steps)


def _with_defaults(state: TrainState, metrics: Metrics, batch: dict):
  """A custom step's metrics, completed with what logging and the NaN guard read."""
  if 'loss' not in metrics:
    raise ConfigError(f'the custom train_step returned metrics {sorted(metrics)} without a '
                      "scalar 'loss'; return (state, {'loss': ..., ...})")
  metrics = dict(metrics)
  metrics.setdefault('count', jnp.sum(batch['mask']))
  metrics.setdefault('grad_norm', jnp.zeros((), jnp.float32))
  return state, metrics


def _with_batch_axes(model, axes, state_mutable):
  """The model with cross-device BatchNorm statistics; refuses silent per-device statistics."""
  if jax.tree.leaves(state_mutable):
    model.check_batch_axes({'params': None, **{k: None for k in state_mutable}})
  return model.with_batch_axes(axes)


def _pmap_step(model, task, tx, mesh: Mesh, lay: Layout, traces: list, evaluate,
               logged: Callable) -> Step:
  """Legacy pmap data parallelism over every device of the mesh (fsdp = tensor = 1)."""
  devices = list(mesh.devices.flat)
  n = len(devices)
  local_model = _with_batch_axes(model, 'batch', state_mutable=lay.shardings.mutable)
  # pmap returns arrays sharded over a mesh named after its axis; placing inputs on that same
  # mesh keeps the second call from compiling again.
  pmap_mesh = jax.make_mesh((n,), ('batch',), axis_types=(AxisType.Auto,), devices=devices)
  stacked = NamedSharding(pmap_mesh, P('batch'))

  def local_grads(state: TrainState, batch: dict):
    count = jax.lax.psum(jnp.sum(batch['mask']), 'batch')
    key = jax.random.fold_in(_dropout_key(state), jax.lax.axis_index('batch'))
    grads, sums, new_mutable = _grads(local_model, task, state.params, state.mutable, batch, key,
                                      count, 1.0 / n)
    return jax.lax.psum(grads, 'batch'), jax.lax.psum(sums, 'batch'), count, new_mutable

  def local_step(state: TrainState, batch: dict):
    traces[0] += 1
    return _update(tx, state, *local_grads(state, batch), logged)

  pmapped = jax.pmap(local_step, axis_name='batch', devices=devices, donate_argnums=0)
  pmapped_grads = jax.pmap(lambda s, b: local_grads(s, b)[0], axis_name='batch', devices=devices)
  # [B, ...] global batch -> [n, B/n, ...], each device's rows already on that device.
  split = jax.jit(lambda b: jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]), b),
                  out_shardings=stacked)
  place = jax.jit(lambda s: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), s),
                  out_shardings=stacked)
  first = lambda tree: jax.tree.map(lambda x: x[0], tree)
  export = jax.jit(first, out_shardings=lay.shardings)
  first = jax.jit(first)  # one dispatch for all metrics, not one eager op per metric

  def train(state, batch):
    new_state, metrics = pmapped(state, split(batch))
    return new_state, first(metrics)

  return Step(train=train, evaluate=evaluate, grads=lambda s, b: first(pmapped_grads(s, split(b))),
              train_many=None, place=place, export=export, trace_count=traces)

"""The pure pieces of a train step: loss and gradients (with micro-batches and a precision policy),
the optimizer update, eval sums, and the StepContext that custom steps recombine.

Losses are sum(loss x mask) / global weight (valid examples, or a task's own weights such as
counted tokens), so every style and every micro-batch split gives the global-batch mean.
Dropout keys: fold_in(rng, step) for the whole global batch (jit style; threefry
is partitionable, so the mask does not depend on the layout), folded with the micro-batch index
under gradient accumulation, and with the device index in shard_map/pmap (spmd.py and pmap.py
beside this module build the compiled steps from these pieces).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from disttrain import moved
from disttrain.data.records import MASK
from disttrain.parallel.accumulation import Gather, microbatched
from disttrain.parallel.state import TrainState

Metrics = dict[str, jax.Array]
# Names that moved to another module resolve there, with a DeprecationWarning.
__getattr__ = moved.names(__name__, {})


@dataclasses.dataclass(frozen=True)
class Variant:
  """Static options of one compiled train step; each distinct Variant compiles once.

  metrics: every metric (the task's, 'count', 'grad_norm') or the loss alone (quiet steps).
  steps: optimizer steps per call (lax.scan over K stacked batches [K, B, ...]).
  full_batch: divide by the static global batch size (batches without padding, as the train
    iterator yields) instead of the summed mask, so no cross-device sum of the mask has to
    finish before the backward pass.
  """
  metrics: bool = True
  steps: int = 1
  full_batch: bool = False

  @functools.cached_property  # looked up every step
  def name(self) -> str:
    """'logged', 'quiet', 'masked' (+ '_xK'): the key in run.json's `compiled`."""
    kind = 'masked' if not self.full_batch else ('logged' if self.metrics else 'quiet')
    return kind + (f'_x{self.steps}' if self.steps > 1 else '')


@dataclasses.dataclass(frozen=True)
class Policy:
  """Mixed precision at the step's edge: float parameters and float inputs are cast to
  `compute_dtype` inside the differentiated function, so the forward and backward passes run in
  it while the parameters, optimizer state and gradients stay float32."""
  compute_dtype: Any = jnp.float32

  def cast(self, tree: Any) -> Any:
    """Floating leaves in compute_dtype (a no-op in float32)."""
    if jnp.dtype(self.compute_dtype) == jnp.float32:
      return tree
    return jax.tree.map(lambda x: x.astype(self.compute_dtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def cast_batch(self, batch: dict) -> dict:
    """The data's floating fields in compute_dtype; the mask stays float32."""
    return {k: v if k == MASK else self.cast(v) for k, v in batch.items()}


def with_mask(batch: dict, lead: int = 1) -> dict:
  """The batch with MASK: train batches come without one (every row is real), so the ones are
  made inside the compiled step instead of crossing the host-device boundary each step.
  `lead`: the leading axes of the batch ([B] = 1, K stacked batches [K, B] = 2)."""
  if MASK in batch:
    return batch
  shape = next(iter(batch.values())).shape[:lead]
  return {**batch, MASK: jnp.ones(shape, jnp.float32)}


def total_weight(task, batch: dict) -> jax.Array:
  """The normaliser of sums over `batch`: the task's example weights summed (NextToken: counted
  tokens), by default the row mask (valid examples)."""
  weights = getattr(task, 'weights', None)
  return jnp.sum(weights(batch) if weights is not None else batch[MASK])


def weighs_rows(task) -> bool:
  """True when every full train batch weighs its row count (a literal in the compiled step): the
  task has no weights of its own."""
  return not hasattr(task, 'weights')


def dropout_key(state: TrainState) -> jax.Array:
  """fold_in(rng, step): the same for every layout."""
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


def _like(new: Any, old: Any) -> Any:
  """New mutable collections in the stored dtypes (a bf16 forward must not change them)."""
  return jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)


def _grads(model, task, params, mutable, batch, rng, policy: Policy, share: float, *, count,
           all_metrics: bool):
  """Gradient of sum(loss x mask) / count + model loss, the masked sums, and new collections.

  `share` is 1 / (number of calls the global batch is split into: devices in shard_map/pmap,
  micro-batches): each call's model loss (a mean over its rows) enters once per call and the sum
  averages; a model loss summed over rows (model_loss_sums_rows) enters whole. `all_metrics=False` sums only the loss. `count` is the global number of valid
  examples: a cross-device sum of the mask, or the static global batch size.
  """
  def loss_fn(params):
    outputs, new_mutable, model_loss = model.apply(
        {'params': policy.cast(params), **mutable}, policy.cast_batch(batch), train=True, rng=rng)
    per_example = task.per_example(outputs, batch)
    if not all_metrics:
      per_example = {'loss': per_example['loss']}
    sums = {k: jnp.sum(v.astype(jnp.float32) * batch[MASK]) for k, v in per_example.items()}
    model_loss = jnp.asarray(model_loss, jnp.float32)
    if not getattr(model, 'model_loss_sums_rows', False):  # a mean over this call's rows
      model_loss = model_loss * share
    objective = (sums['loss'] + model_loss * count) / count
    name = apart_name(model)  # records divide sums by count
    if name is None:  # reported inside 'loss'
      sums['loss'] = sums['loss'] + model_loss * count
    elif all_metrics:  # apart (language models' router losses); 'loss' is the data loss
      sums[name] = model_loss * count
    return objective, (sums, new_mutable)
  with jax.named_scope('loss_and_grads'):
    (_, (sums, new_mutable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return grads, sums, _like(new_mutable, mutable)


def accumulated_grads(ctx: 'StepContext', params, mutable, batch, rng, count, share: float = 1.0,
                      all_metrics: bool = True):
  """(grads, sums, new mutable) of `batch` under ctx's policy, in ctx.micro_batches pieces."""
  # The count's reduction before the model's: XLA:CPU runs independent collectives in any order
  # per device, and a count all-reduce beside a model's own (MoE) deadlocked 8 CPU devices.
  batch, count = jax.lax.optimization_barrier((batch, count))
  one = functools.partial(_grads, ctx.model, ctx.task, count=count, all_metrics=all_metrics)
  return microbatched(one, ctx.micro_batches, ctx.gather)(params, mutable, batch, rng,
                                                          ctx.policy, share)


def update(tx, state: TrainState, grads, sums, count, new_mutable, all_metrics: bool = True,
           report_count: bool = False) -> tuple[TrainState, Metrics]:
  """One optimizer step; metrics = sums / count, plus count and grad_norm if `all_metrics`
  (count alone with `report_count`: a quiet step whose weight the records cannot know).

  A global norm is one more pass over every gradient, so only the logged steps' variant
  computes it (docs/performance.md).
  """
  with jax.named_scope('optimizer_update'):
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1,
                              params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state, mutable=new_mutable)
  metrics = {k: v / count for k, v in sums.items()}
  if all_metrics:
    metrics.update(count=count, grad_norm=optax.tree.norm(grads))
  elif report_count:
    metrics['count'] = count
  return new_state, metrics


def _masked_sum(values: jax.Array, batch: dict) -> jax.Array:
  """sum(values x mask); a padding row's value is dropped, not multiplied: the all-zero row can
  give NaN (x / |x|, a loss over a zero weight), and NaN x 0 is NaN."""
  mask = batch[MASK].reshape(batch[MASK].shape + (1,) * (values.ndim - batch[MASK].ndim))
  return jnp.sum(jnp.where(mask > 0, values.astype(jnp.float32) * mask, 0.0))


def eval_sums(model, task, state: TrainState, batch: dict, policy: Policy) -> Metrics:
  """Masked sums of the task's per-example values over an eval batch, with 'count' (the summed
  weights), and for per-token tasks 'num_examples' and 'num_tokens'."""
  count = total_weight(task, batch)
  batch, count = jax.lax.optimization_barrier((batch, count))  # as in accumulated_grads
  outputs, _, model_loss = model.apply({'params': policy.cast(state.params), **state.mutable},
                                       policy.cast_batch(batch), train=False, rng=None)
  sums = {k: _masked_sum(v, batch) for k, v in task.per_example(outputs, batch).items()}
  sums['count'] = count
  if getattr(task, 'per_token', False):
    sums.update(num_examples=jnp.sum(batch[MASK]), num_tokens=sums['count'])
  model_loss = jnp.asarray(model_loss, jnp.float32) * sums['count']
  name = apart_name(model)
  if name is not None:
    sums[name] = model_loss
  elif 'loss' in sums:
    sums['loss'] = sums['loss'] + model_loss
  return sums


def apart_name(model) -> str | None:
  """The record field a model's own loss is reported under instead of inside 'loss' (language
  models with experts: 'router_loss'), or None."""
  return getattr(model, 'model_loss_name', None)


@jax.jit
def params_finite(params: Any) -> jax.Array:
  """True if every parameter is finite: checked before each save."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


@dataclasses.dataclass(frozen=True)
class StepContext:
  """What a user-supplied train or eval step gets: the framework's own pieces of its steps.

  The default train step is `apply_gradients(state, *loss_and_grads(state, batch))`; a custom
  one (two optimizers, GAN-style alternation, ...) recombines these and keeps sharding, data,
  precision, gradient accumulation, checkpoints and logging. It must return (new state, metrics)
  with a scalar 'loss'. A custom eval step returns masked sums over the batch (see eval_sums).
  """
  model: Any
  task: Any
  tx: optax.GradientTransformation
  policy: Policy = Policy()
  micro_batches: int = 1
  gather: Gather | None = None

  def dropout_key(self, state: TrainState) -> jax.Array:
    """fold_in(rng, step): the same for every layout."""
    return dropout_key(state)

  def loss_and_grads(self, state: TrainState, batch: dict, params: Any = None):
    """(grads, masked sums, global weight, new mutable) of the global-batch mean loss."""
    count = total_weight(self.task, batch)
    grads, sums, new_mutable = accumulated_grads(
        self, state.params if params is None else params, state.mutable, batch,
        dropout_key(state), count)
    return grads, sums, count, new_mutable

  def apply_gradients(self, state: TrainState, grads, sums, count, new_mutable):
    """One optimizer update with `tx`; metrics = sums / count, count, grad_norm."""
    return update(self.tx, state, grads, sums, count, new_mutable)

  def outputs(self, state: TrainState, batch: dict) -> Any:
    """The model's outputs in eval mode (the precision policy applied)."""
    outputs, _, _ = self.model.apply({'params': self.policy.cast(state.params), **state.mutable},
                                     self.policy.cast_batch(batch), train=False, rng=None)
    return outputs

  def eval_sums(self, state: TrainState, batch: dict) -> Metrics:
    """The default eval step's masked sums (the task's values, 'loss', 'count')."""
    return eval_sums(self.model, self.task, state, batch, self.policy)

  @staticmethod
  def masked_sum(values_B: jax.Array, batch: dict) -> jax.Array:
    """sum(values x mask) over the batch: padding rows count for nothing."""
    return _masked_sum(values_B, batch)


def with_batch_axes(model, axes, state_mutable):
  """The model with cross-device BatchNorm statistics; refuses silent per-device statistics."""
  if jax.tree.leaves(state_mutable):
    model.check_batch_axes({'params': None, **{k: None for k in state_mutable}})
  return model.with_batch_axes(axes)


def per_device_grads(ctx: StepContext, params, mutable, batch, key, count, axes, ways: int,
                     all_metrics: bool):
  """shard_map/pmap: this device's share of the gradient, summed over `axes` once (after any
  micro-batch loop). Dropout keys are folded with the device's index along `axes`."""
  key = jax.random.fold_in(key, jax.lax.axis_index(axes))
  grads, sums, new_mutable = accumulated_grads(ctx, params, mutable, batch, key, count,
                                               1.0 / ways, all_metrics)
  # Each device holds d(its loss x mask sum / global count); their sum is the global gradient.
  return jax.lax.psum(grads, axes), jax.lax.psum(sums, axes), new_mutable

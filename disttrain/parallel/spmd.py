"""Step styles: one class each, from the pure pieces in disttrain/parallel/step.py.

  JitStep       GSPMD: the step is written for the global batch; XLA inserts the collectives.
  ShardMapStep  each device computes loss x mask sums and gradients of its rows; explicit psum
                over the batch axes; the optimizer update then runs sharded (GSPMD). Parameters
                enter replicated: fsdp shards are gathered once, before the step.
  (pmap: disttrain/parallel/pmap.py, which keeps a replicated state of its own.)
A style says how `grads` of the global batch are computed; StepStyle does the rest the same way
for all of them (the optimizer update, K steps per call, the compiled variants), so a new way to
split (pipeline stages) is a new subclass.
"""

import collections
import contextlib
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from disttrain.config import Config
from disttrain.data.global_arrays import stacked_sharding
from disttrain.data.records import MASK
from disttrain.errors import ConfigError
from disttrain.parallel import accumulation, pmap, sharding as sharding_lib, step as step_lib
from disttrain.parallel.compiled import Steps
from disttrain.parallel.mesh import Parallelism
from disttrain.parallel.state import Layout, TrainState
from disttrain.parallel.step import Metrics, StepContext, Variant


def context(model, task, tx, cfg: Config, mesh: Mesh, lay: Layout) -> StepContext:
  """The StepContext of a config: precision policy, micro-batches, fsdp gathering."""
  parallel, gather = Parallelism(mesh), None
  # Pipeline stages run the micro-batches themselves (disttrain/models/pipeline.py).
  micro_batches = cfg.grad_accum_steps if parallel.stages == 1 else 1
  if micro_batches > 1 and cfg.step_mode == 'jit' and parallel.fsdp > 1:
    gather = accumulation.Gather(whole=parallel.without_fsdp(lay.param_specs),
                                 split=lay.shardings.params)
  return StepContext(model=model, task=task, tx=tx,
                     policy=step_lib.Policy(jnp.dtype(cfg.precision.compute_dtype)),
                     micro_batches=micro_batches, gather=gather)


class StepStyle:
  """What every style shares around its `grads`: the update, K steps per call, the variants."""

  def __init__(self, ctx: StepContext, cfg: Config, parallel: Parallelism, lay: Layout,
               batch_sharding: NamedSharding, train_step: Callable | None = None):
    self.ctx, self.cfg, self.parallel, self.lay = ctx, cfg, parallel, lay
    self.batch_sharding, self.train_step = batch_sharding, train_step
    self.traces = collections.Counter()
    # Full batches of a task without weights of its own weigh their rows: a literal in the step.
    self.full_count = (np.float32(cfg.global_batch_size) if step_lib.weighs_rows(ctx.task)
                       else None)

  def grads(self, state: TrainState, batch: dict, all_metrics: bool, full_batch: bool):
    """(grads, masked sums, global weight, new mutable collections) of the global batch."""
    raise NotImplementedError

  def tracing(self):
    """What the step is traced under (jit: the activation rules)."""
    return contextlib.nullcontext()

  def one_step(self, state, batch, all_metrics: bool, full_batch: bool):
    if self.train_step is not None:
      return _with_defaults(self.ctx.task, *self.train_step(self.ctx, state, batch),
                                    batch)
    grads, sums, count, new_mutable = self.grads(state, batch, all_metrics, full_batch)
    return step_lib.update(self.ctx.tx, state, grads, sums, count, new_mutable, all_metrics,
                           report_count=self.full_count is None)

  def run(self, variant: Variant, state, batch):
    """One call: one step, or K (lax.scan over [K, B, ...]) whose last reports every metric."""
    batch = step_lib.with_mask(batch, 1 if variant.steps == 1 else 2)
    if variant.steps == 1:
      return self.one_step(state, batch, variant.metrics, variant.full_batch)
    quiet = lambda s, b: self.one_step(s, b, False, variant.full_batch)
    if not variant.metrics or self.train_step is not None:
      step = quiet if self.train_step is None else (lambda s, b: self.one_step(s, b, True, False))
      return jax.lax.scan(step, state, batch)
    state, first = jax.lax.scan(quiet, state, jax.tree.map(lambda x: x[:-1], batch))
    state, last = self.one_step(state, jax.tree.map(lambda x: x[-1], batch), True,
                                variant.full_batch)
    metrics = dict(last)
    for key in first:
      metrics[key] = jnp.concatenate([first[key], last[key][None]])
    return state, metrics

  def make_train(self, variant: Variant):
    def counted(state, batch):
      self.traces[variant.name] += 1
      with self.tracing():
        return self.run(variant, state, batch)
    return jax.jit(counted, in_shardings=(self.lay.shardings, stacked_sharding(
        self.batch_sharding, variant.steps)), out_shardings=(self.lay.shardings, self.replicated),
                   donate_argnums=0)

  @functools.cached_property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.parallel.mesh, P())

  def build(self, evaluate) -> Steps:
    def grads_only(state, batch):
      with self.tracing():
        return self.grads(state, step_lib.with_mask(batch), True, False)[0]
    grads = jax.jit(grads_only, in_shardings=(self.lay.shardings, self.batch_sharding),
                    out_shardings=self.lay.shardings.params)
    return Steps(make_train=self.make_train, evaluate=evaluate, grads=grads,
                 place=lambda state: state, export=lambda state: state, traces=self.traces,
                 custom=self.train_step is not None)


class JitStep(StepStyle):
  """The step written for the global batch; GSPMD splits it as the shardings and the activation
  rules say."""

  def tracing(self):
    return sharding_lib.activation_rules(self.parallel.mesh, self.cfg.logical_rules,
                                         self.cfg.grad_accum_steps)

  def grads(self, state, batch, all_metrics, full_batch):
    ctx = self.ctx
    if getattr(ctx.model, 'splits_sequence', False):  # tokens [B, T] split over context
      batch = self.parallel.constrain_batch(batch, ctx.model.tokens_per_example(batch))
    count = (self.full_count if full_batch and self.full_count is not None
             else step_lib.total_weight(ctx.task, batch))
    grads, sums, new_mutable = step_lib.accumulated_grads(
        ctx, state.params, state.mutable, batch, step_lib.dropout_key(state), count,
        all_metrics=all_metrics)
    return grads, sums, count, new_mutable


class ShardMapStep(StepStyle):
  """Each device's rows under shard_map, its gradient psum'd over the batch axes."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    axes = self.parallel.batch_axes
    self.local = StepContext(**{**self.ctx.__dict__, 'model': step_lib.with_batch_axes(
        self.ctx.model, axes, state_mutable=self.lay.shardings.mutable)})

  def _local_grads(self, params, mutable, batch, key, all_metrics, full_batch):
    axes = self.parallel.batch_axes
    count = (self.full_count if full_batch and self.full_count is not None
             else jax.lax.psum(step_lib.total_weight(self.ctx.task, batch), axes))
    grads, sums, new_mutable = step_lib.per_device_grads(
        self.local, params, mutable, batch, key, count, axes, self.parallel.batch_ways,
        all_metrics)
    return grads, sums, count, new_mutable

  def grads(self, state, batch, all_metrics, full_batch):
    # check_vma=False: the psums are written out rather than implied by varying types.
    sharded = jax.shard_map(
        functools.partial(self._local_grads, all_metrics=all_metrics, full_batch=full_batch),
        mesh=self.parallel.mesh, in_specs=(P(), P(), P(self.parallel.batch_axes), P()),
        out_specs=(P(), P(), P(), P()), check_vma=False)
    return sharded(state.params, state.mutable, batch, step_lib.dropout_key(state))


def _with_defaults(task, state: TrainState, metrics: Metrics, batch: dict):
  """A custom step's metrics, completed with what logging and the NaN guard read."""
  if 'loss' not in metrics:
    raise ConfigError(f'the custom train_step returned metrics {sorted(metrics)} without a '
                      "scalar 'loss'; return (state, {'loss': ..., ...})")
  metrics = dict(metrics)
  metrics.setdefault('count', step_lib.total_weight(task, batch))
  return state, metrics


def _with_count(sums: Metrics, batch: dict) -> Metrics:
  """A custom eval step's sums, with the batch's valid count unless it gave its own."""
  if not isinstance(sums, dict):
    raise ConfigError(f'the custom eval_step returned {type(sums).__name__}; return a dict of '
                      'masked sums over the batch, e.g. {"top5": ctx.masked_sum(correct, batch)}')
  return {'count': jnp.sum(batch[MASK]), **sums}


STYLES = {'jit': JitStep, 'shard_map': ShardMapStep}


def build(model, task, tx, cfg: Config, mesh: Mesh, lay: Layout, batch_sharding: NamedSharding,
          train_step: Callable | None = None, eval_step: Callable | None = None) -> Steps:
  """The train and eval steps of `cfg.step_mode`, jitted with shardings and donation.

  `train_step(ctx, state, batch) -> (state, metrics)` replaces the default update (jit style
  only: it is written for the global batch); its metrics are reported every step.
  `eval_step(ctx, state, batch) -> masked sums` replaces the default eval sums.
  """
  if train_step is not None and cfg.step_mode != 'jit':
    raise ConfigError(f'a custom train_step is written for the global batch and runs with '
                      f'step_mode=jit, not {cfg.step_mode}; pass --config.step_mode=jit')
  ctx = context(model, task, tx, cfg, mesh, lay)
  if eval_step is None:
    eval_fn = lambda state, batch: ctx.eval_sums(state, batch)
  else:
    eval_fn = lambda state, batch: _with_count(eval_step(ctx, state, batch), batch)
  if cfg.step_mode == 'jit':  # activations split as in the train step (e.g. positions)
    def eval_fn(state, batch, unsplit=eval_fn):
      with sharding_lib.activation_rules(mesh, cfg.logical_rules):
        return unsplit(state, batch)
  evaluate = jax.jit(eval_fn, in_shardings=(lay.shardings, batch_sharding),
                     out_shardings=NamedSharding(mesh, P()))
  if cfg.step_mode == 'pmap':
    return pmap.build(ctx, mesh, lay, evaluate, batch_sharding, cfg.global_batch_size)
  style = STYLES[cfg.step_mode](ctx, cfg, Parallelism(mesh), lay, batch_sharding, train_step)
  return style.build(evaluate)

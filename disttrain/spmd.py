"""The jit and shard_map styles of the train step, from the pure pieces in disttrain/step.py.

  jit        GSPMD: the step is written for the global batch; XLA inserts the collectives.
  shard_map  each device computes loss x mask sums and gradients of its rows; explicit psum over
             the batch axes ('data', 'fsdp'); the optimizer update then runs sharded (GSPMD).
             Parameters enter replicated: fsdp shards are gathered once, before the step.
"""

import collections
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from disttrain import mesh as mesh_lib, pmap, sharding as sharding_lib, step as step_lib
from disttrain.compiled import Steps
from disttrain.config import BATCH_AXES, Config
from disttrain.errors import ConfigError
from disttrain.state import Layout, TrainState
from disttrain.step import StepContext, Variant


def _without_fsdp(mesh: Mesh, specs) -> object:
  """NamedShardings of the parameters with the fsdp axis removed (whole along it)."""
  def drop(spec: P) -> NamedSharding:
    entries = []
    for entry in spec:
      names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n != 'fsdp')
      entries.append(names if len(names) > 1 else (names[0] if names else None))
    return NamedSharding(mesh, P(*entries))
  return jax.tree.map(drop, specs, is_leaf=lambda x: isinstance(x, P))


def context(model, task, tx, cfg: Config, mesh: Mesh, lay: Layout) -> StepContext:
  """The StepContext of a config: precision policy, micro-batches, fsdp gathering."""
  gather = None
  if cfg.grad_accum_steps > 1 and cfg.step_mode == 'jit' and mesh.shape['fsdp'] > 1:
    gather = step_lib.Gather(whole=_without_fsdp(mesh, lay.param_specs),
                             split=lay.shardings.params)
  return StepContext(model=model, task=task, tx=tx,
                     policy=step_lib.Policy(jnp.dtype(cfg.precision.compute_dtype)),
                     micro_batches=cfg.grad_accum_steps, gather=gather)


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
  replicated = NamedSharding(mesh, P())
  if eval_step is None:
    eval_fn = lambda state, batch: ctx.eval_sums(state, batch)
  else:
    eval_fn = lambda state, batch: step_lib.with_count(eval_step(ctx, state, batch), batch)
  if cfg.step_mode == 'jit':  # activations split as in the train step (e.g. positions)
    def eval_fn(state, batch, unsplit=eval_fn):
      with sharding_lib.activation_rules(mesh, cfg.logical_rules):
        return unsplit(state, batch)
  evaluate = jax.jit(eval_fn, in_shardings=(lay.shardings, batch_sharding),
                     out_shardings=replicated)
  if cfg.step_mode == 'pmap':
    return pmap.build(ctx, mesh, lay, evaluate, batch_sharding, cfg.global_batch_size)

  traces = collections.Counter()
  # Full batches of a task without weights of its own weigh their rows: a literal in the step.
  full_count = np.float32(cfg.global_batch_size) if step_lib.weighs_rows(task) else None
  if cfg.step_mode == 'jit':
    def grads_fn(state: TrainState, batch: dict, all_metrics: bool, full_batch: bool):
      count = full_count if full_batch and full_count is not None else step_lib.total_weight(
          task, batch)
      grads, sums, new_mutable = step_lib.accumulated_grads(
          model, task, state.params, state.mutable, batch, step_lib.dropout_key(state), count,
          ctx.policy, ctx.micro_batches, all_metrics=all_metrics, gather=ctx.gather)
      return grads, sums, count, new_mutable
  else:  # shard_map
    local = StepContext(**{**ctx.__dict__, 'model': step_lib.with_batch_axes(
        model, BATCH_AXES, state_mutable=lay.shardings.mutable)})
    ways = mesh_lib.batch_ways(mesh)

    def local_grads(params, mutable, batch, key, all_metrics, full_batch):
      count = full_count if full_batch and full_count is not None else jax.lax.psum(
          step_lib.total_weight(task, batch), BATCH_AXES)
      grads, sums, new_mutable = step_lib.per_device_grads(local, params, mutable, batch, key,
                                                           count, BATCH_AXES, ways, all_metrics)
      return grads, sums, count, new_mutable

    def grads_fn(state: TrainState, batch: dict, all_metrics: bool, full_batch: bool):
      # check_vma=False: the psums above are written out rather than implied by varying types.
      sharded = jax.shard_map(functools.partial(local_grads, all_metrics=all_metrics,
                                                full_batch=full_batch), mesh=mesh,
                              in_specs=(P(), P(), P(BATCH_AXES), P()),
                              out_specs=(P(), P(), P(), P()), check_vma=False)
      return sharded(state.params, state.mutable, batch, step_lib.dropout_key(state))

  def one_step(state, batch, all_metrics: bool, full_batch: bool):
    if train_step is not None:
      return step_lib.with_defaults(task, *train_step(ctx, state, batch), batch)
    grads, sums, count, new_mutable = grads_fn(state, batch, all_metrics, full_batch)
    return step_lib.update(tx, state, grads, sums, count, new_mutable, all_metrics,
                           report_count=full_count is None)

  def run(variant: Variant, state, batch):
    batch = step_lib.with_mask(batch, 1 if variant.steps == 1 else 2)
    if variant.steps == 1:
      return one_step(state, batch, variant.metrics, variant.full_batch)
    quiet = lambda s, b: one_step(s, b, False, variant.full_batch)
    if not variant.metrics or train_step is not None:
      step = quiet if train_step is None else (lambda s, b: one_step(s, b, True, False))
      return jax.lax.scan(step, state, batch)
    # K-1 quiet steps, then the step that ends the record with every metric.
    state, first = jax.lax.scan(quiet, state, jax.tree.map(lambda x: x[:-1], batch))
    state, last = one_step(state, jax.tree.map(lambda x: x[-1], batch), True, variant.full_batch)
    metrics = dict(last)
    for key in first:
      metrics[key] = jnp.concatenate([first[key], last[key][None]])
    return state, metrics

  stacked = NamedSharding(mesh, P(None, BATCH_AXES))

  def make_train(variant: Variant):
    def counted(state, batch):
      traces[variant.name] += 1
      if cfg.step_mode != 'jit':
        return run(variant, state, batch)
      with sharding_lib.activation_rules(mesh, cfg.logical_rules):
        return run(variant, state, batch)
    return jax.jit(counted,
                   in_shardings=(lay.shardings, stacked if variant.steps > 1 else batch_sharding),
                   out_shardings=(lay.shardings, replicated), donate_argnums=0)

  grads = jax.jit(lambda state, batch: grads_fn(state, step_lib.with_mask(batch), True, False)[0],
                  in_shardings=(lay.shardings, batch_sharding), out_shardings=lay.shardings.params)
  return Steps(make_train=make_train, evaluate=evaluate, grads=grads, place=lambda state: state,
               export=lambda state: state, traces=traces, custom=train_step is not None)

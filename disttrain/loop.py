"""The training loop: one function, read top to bottom."""

import dataclasses
import platform
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import disttrain
from disttrain import checkpoint, data, distributed, metrics, models, optim, sources
from disttrain import mesh as mesh_lib
from disttrain import sharding as sharding_lib
from disttrain import state as state_lib
from disttrain import step as step_lib
from disttrain.config import BATCH_AXES, Config
from disttrain.errors import ConfigError, NonFiniteError, Preempted
from disttrain.task import Classification


@dataclasses.dataclass
class Result:
  """What a run leaves behind in memory (the files are in the workdir)."""
  state: state_lib.TrainState
  records: list[dict]  # the metrics.jsonl records, also on processes that do not write
  trace_count: int  # most traces of any train-step variant; 1 = each compiled once


def check_batch_sizes(cfg: Config, mesh: Mesh) -> None:
  """Both batch sizes must split evenly over the batch axes."""
  ways = mesh.shape['data'] * mesh.shape['fsdp']
  for name, size in (('global_batch_size', cfg.global_batch_size),
                     ('eval_batch_size', cfg.eval_batch)):
    if size % ways:
      raise ConfigError(f'{name}={size} is not divisible by the {ways} devices on mesh axes '
                        f'{BATCH_AXES}; use a multiple of {ways}')


def _must_bound_in_flight(mesh: Mesh) -> bool:
  # XLA:CPU's in-process all-reduce deadlocks when many multi-device steps are queued on few
  # cores (measured: aborts after a 40 s rendezvous timeout). Accelerators do not need this.
  return mesh.devices.flat[0].platform == 'cpu' and mesh.size > 1


def evaluate(step: step_lib.Step, state: state_lib.TrainState, split: sources.Split,
             batch_size: int, batch_sharding) -> dict[str, float]:
  """Loss and accuracy over every eval example exactly once (the last batch padded and masked)."""
  totals: dict[str, float] = {}
  pending = None
  for batch in data.eval_batches(split, batch_size, batch_sharding):
    sums = step.evaluate(state, batch)
    if pending is not None:  # fetch one batch late: the device stays busy, <= 2 in flight
      for k, v in jax.device_get(pending).items():
        totals[k] = totals.get(k, 0.0) + float(v)
    pending = sums
  for k, v in jax.device_get(pending).items():
    totals[k] = totals.get(k, 0.0) + float(v)
  count = totals.pop('count')
  out = {k: v / count for k, v in totals.items()}
  out['num_examples'] = int(count)
  return out


def _train_record(step: int, window: list[dict], lr: float, examples_per_sec: float) -> dict:
  """A train record over the steps since the last one.

  Metrics every step reports ('loss', and with the default step the task's metrics) are averaged
  over those global batches, weighted by count; the others (grad_norm) are the last step's.
  """
  counts = np.array([float(m['count']) for m in window])
  record = {'step': step, 'split': 'train'}
  every_step = set(window[0]).intersection(*window[1:])
  for key, value in window[-1].items():
    if key == 'count':
      continue
    if key in every_step:
      record[key] = float(np.sum([float(m[key]) for m in window] * counts) / counts.sum())
    else:
      record[key] = float(value)
  record.setdefault('grad_norm', 0.0)  # a custom step without one: the field is always there
  record.update(learning_rate=lr, examples_per_sec=examples_per_sec)
  return record


def run_info(cfg: Config, mesh: Mesh, lay: state_lib.Layout) -> dict:
  """The contents of run.json."""
  return {
      'config': cfg.to_dict(),
      'mesh': mesh_lib.axis_sizes(mesh),
      'num_devices': mesh.size,
      'num_processes': jax.process_count(),
      'step_mode': cfg.step_mode,
      'param_specs': sharding_lib.spec_lists(lay.param_specs),
      'fsdp_replicated': lay.replicated,
      'versions': {'disttrain': disttrain.__version__, 'jax': jax.__version__,
                   'python': platform.python_version()},
      'platform': mesh.devices.flat[0].platform,
  }


@dataclasses.dataclass
class Setup:
  """Everything a run is built from, before any step: also what tests and benchmarks drive."""
  cfg: Config
  mesh: Mesh
  dataset: sources.Dataset
  model: Any
  task: Any
  tx: Any
  lr_schedule: Any  # logged as learning_rate
  batch_sharding: Any
  state: state_lib.TrainState  # fresh, created sharded
  layout: state_lib.Layout
  step: step_lib.Step


def setup(cfg: Config, model: Any = None, task: Any = None,
          devices: Sequence[jax.Device] | None = None, tx: Any = None,
          train_step: Any = None) -> Setup:
  """Mesh, data, model, optimizer, sharded state and compiled-on-first-call steps for `cfg`."""
  mesh = mesh_lib.build(cfg.mesh, devices)
  check_batch_sizes(cfg, mesh)
  dataset = sources.load(cfg.data)
  model = model or models.build(cfg.model, dataset.num_classes)
  task = task or Classification()
  config_tx, lr_schedule = optim.build(cfg)  # the schedule is what records log as learning_rate
  tx = tx or config_tx
  batch_sharding = data.batch_sharding(mesh)
  state, lay = state_lib.create(model, tx, state_lib.sample_batch(dataset.train.image.shape[1:],
                                                      dataset.train.image.dtype),
                                cfg, mesh)
  step = step_lib.build(model, task, tx, cfg, mesh, lay, batch_sharding, train_step)
  return Setup(cfg, mesh, dataset, model, task, tx, lr_schedule, batch_sharding, state, lay, step)


def train(cfg: Config, workdir: str, model: Any = None, task: Any = None,
          devices: Sequence[jax.Device] | None = None, tx: Any = None,
          train_step: Any = None) -> Result:
  """Trains `model` (default: the one cfg.model names) per `cfg`, writing outputs to `workdir`.

  Levels of disclosure: the config alone; your own `model` (any front end in disttrain.models)
  and `task` (per-example loss and metrics); your own optax `tx` and/or `train_step(ctx, state,
  batch) -> (state, metrics)` (see step.StepContext). Sharding, data, checkpoints and logging
  stay the same. Resumes from the newest complete checkpoint in `workdir` if there is one.
  `devices` defaults to every device of every process. Raises NonFiniteError on a NaN/Inf loss
  or gradient norm and Preempted after saving on SIGTERM.
  """
  run = setup(cfg, model, task, devices, tx, train_step)
  mesh, dataset = run.mesh, run.dataset
  writer = metrics.Writer(workdir, enabled=jax.process_index() == 0)
  writer.write_run(run_info(cfg, mesh, run.layout))
  writer.print(f'disttrain: {mesh.size} devices, mesh {mesh_lib.axis_sizes(mesh)}, '
               f'step_mode={cfg.step_mode}, sharding={cfg.sharding}, data={cfg.data.name} '
               f'({len(dataset.train)} train / {len(dataset.eval)} eval)')
  batches = data.TrainIterator(dataset.train, cfg.global_batch_size, cfg.seed,
                               run.batch_sharding, prefetch=cfg.data.prefetch,
                               batches_per_element=cfg.steps_per_dispatch)
  ckpt = checkpoint.Checkpointer(workdir, cfg)
  watch = distributed.PreemptionWatch()
  try:
    state = _restore_or_init(ckpt, cfg, run.state, run.layout, batches, writer)
    run.state = None  # donated to the first step: never touch it again
    return _loop(cfg, workdir, mesh, run.step, state, batches, dataset, run.batch_sharding,
                 run.lr_schedule, ckpt, watch, writer)
  finally:
    watch.close()
    ckpt.close()  # waits for async saves to commit (and raises their errors)
    writer.close()


def _restore_or_init(ckpt, cfg: Config, state, lay, batches, writer):
  """The newest checkpoint of this workdir, else a warm start from restore_from, else `state`."""
  abstract = checkpoint.abstract_like(lay.shardings, state)
  restored = ckpt.restore_latest(abstract)
  if restored is not None:
    state, data_state, _, at = restored
    batches.set_state(data_state)  # the data order continues exactly where it stopped
    writer.print(f'resumed from step {at}: {ckpt.directory}/{at}')
    return state
  if cfg.restore_from:
    params, mutable, at = checkpoint.restore_params(cfg.restore_from, abstract)
    writer.print(f'warm start: params from {cfg.restore_from} (step {at}); optimizer, step and '
                 'data order start fresh')
    return state.replace(params=params, mutable=mutable)
  return state


def _loop(cfg, workdir, mesh, step, state, batches, dataset, batch_sharding, lr_schedule, ckpt,
          watch, writer) -> Result:
  """Train steps, records, evals, checkpoints; returns the final state and the records."""
  records: list[dict] = []

  def emit(record: dict) -> None:
    records.append(record)
    writer.write(record)

  def run_eval(at_step: int, device_state) -> dict:
    result = evaluate(step, step.export(device_state), dataset.eval, cfg.eval_batch,
                      batch_sharding)
    emit({'step': at_step, 'split': 'eval', **result})
    writer.print(f'eval  step {at_step}: {_summary(result)} ({result["num_examples"]} examples)')
    return result

  def last_saved() -> int | None:
    ckpt.wait()  # a save still committing is the last good checkpoint too
    return (ckpt.steps() or [None])[-1]

  def checked(window: list) -> list:
    """Fetches [(steps, metrics)] as [(step, metrics)]; a non-finite step stops the run unsaved."""
    flat = []
    for steps, m in jax.device_get(window):
      if len(steps) == 1:
        flat.append((steps[0], m))
        continue
      # One dispatch of K steps: per-step metrics have a leading [K] axis, the rest (scalars)
      # belong to its last step.
      per_step = [k for k, v in m.items() if np.ndim(v) == 1]
      for i, at in enumerate(steps):
        entry = {k: m[k][i] for k in per_step}
        if at == steps[-1]:
          entry.update((k, v) for k, v in m.items() if k not in per_step)
        flat.append((at, entry))
    for _, m in flat:
      m.setdefault('count', cfg.global_batch_size)  # quiet steps: full batches
    for at, m in flat:
      checked_values = {k: float(m[k]) for k in ('loss', 'grad_norm') if k in m}
      if not all(np.isfinite(v) for v in checked_values.values()):
        values = ' '.join(f'{k}={v}' for k, v in checked_values.items())
        raise NonFiniteError(
            f'step {at}: {values} is not finite; that state was not saved, the last checkpoint '
            f'is step {last_saved()} in {ckpt.directory}; lower learning_rate or check the data')
    return [([at], m) for at, m in flat]

  def write_train_record(window: list) -> None:
    window = checked(window)
    at = window[-1][0][0]
    examples_per_sec, eta = meter.tick(at, len(window) * cfg.global_batch_size)
    record = _train_record(at, [m for _, m in window], float(lr_schedule(at - 1)),
                           examples_per_sec)
    emit(record)
    writer.print(f'train step {at}/{cfg.num_train_steps}: loss {record["loss"]:.4f} '
                 f'{examples_per_sec:,.0f} examples/s, ETA {metrics.format_eta(eta)}')

  bound_in_flight = _must_bound_in_flight(mesh)
  first_step = int(state.step)
  device_state = step.place(state)
  del state  # donated to the first step: never touch it again
  meter = metrics.Meter(first_step, cfg.num_train_steps)
  window, due, previous = [], None, None
  per_call = cfg.steps_per_dispatch
  # K > 1: K steps in one compiled call; every cadence below is a multiple of K.
  start = time.perf_counter()
  for step_no in range(first_step + per_call, cfg.num_train_steps + 1, per_call):
    last = step_no == cfg.num_train_steps
    logged = step_no % cfg.log_every_steps == 0 or last
    # The steps between records run the quiet variant (loss and count only; no grad_norm).
    run_steps = step.for_call(logged, per_call)
    device_state, step_metrics = run_steps(device_state, next(batches))
    if bound_in_flight and previous is not None:
      jax.block_until_ready(previous)  # at most two multi-device steps in flight (see above)
    previous = step_metrics
    # The record due at the previous step is fetched only now, with this step queued, so
    # logging never leaves the device idle.
    if due is not None:
      write_train_record(due)
      due = None
    window.append((list(range(step_no - per_call + 1, step_no + 1)), step_metrics))
    if logged:
      due, window = window, []
    eval_due = last or (cfg.eval_every_steps and step_no % cfg.eval_every_steps == 0)
    save_due = last or (cfg.checkpoint_every_steps
                        and step_no % cfg.checkpoint_every_steps == 0)
    preempted = watch.reached(step_no)
    if not (eval_due or save_due or preempted):
      continue
    # Order matters: every step up to this one is checked finite before anything is saved, and
    # records stay in step order.
    if due is not None:
      write_train_record(due)
      due = None
    window = checked(window)
    result = run_eval(step_no, device_state) if eval_due else None
    if save_due or preempted:
      exported = step.export(device_state)
      # grad_norm is only computed on logged steps: the parameters themselves are checked here,
      # so a non-finite state is never saved whatever step it appears at.
      if not bool(step_lib.params_finite(exported.params)):
        raise NonFiniteError(
            f'step {step_no}: the parameters are not finite (the losses up to here were); that '
            f'state was not saved, the last checkpoint is step {last_saved()} in '
            f'{ckpt.directory}; lower learning_rate')
      ckpt.save(step_no, exported, batches.get_state(), _meta(cfg, mesh, step_no),
                metrics=result)
    if preempted:
      ckpt.wait()  # the checkpoint must have committed before the process exits
      raise Preempted(step_no, ckpt.directory)
  if first_step >= cfg.num_train_steps:
    writer.print(f'already at step {first_step} of {cfg.num_train_steps}: nothing to train')
    result = run_eval(first_step, device_state)
  elapsed = time.perf_counter() - start
  writer.print(f'done: {cfg.num_train_steps - first_step} steps in {elapsed:.1f}s on '
               f'{mesh.size} devices {mesh_lib.axis_sizes(mesh)}; final eval {_summary(result)} '
               f'({result["num_examples"]} examples); outputs in {workdir}')
  return Result(state=step.export(device_state), records=records,
                trace_count=step.trace_count)


def _summary(result: dict) -> str:
  """'accuracy 0.9650, loss 0.1140': accuracy first when the task has it, then the rest."""
  names = sorted(k for k in result if k != 'num_examples')
  names.sort(key=lambda k: k != 'accuracy')
  return ', '.join(f'{k} {result[k]:.4f}' for k in names)


def _meta(cfg: Config, mesh: Mesh, step_no: int) -> dict:
  """Run metadata stored with each checkpoint."""
  return {'step': step_no, 'config': cfg.to_dict(), 'mesh': mesh_lib.axis_sizes(mesh),
          'num_processes': jax.process_count(), 'disttrain_version': disttrain.__version__}

"""train(): a run in its workdir (the lease, its events, failures posted to the other processes),
built (setup, the first state: a checkpoint, a warm start or init; the pre-flight) for the loop
over steps in training/step_loop.py.
"""

import contextlib
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp

import disttrain
from disttrain import errors
from disttrain.config import Config
from disttrain.data import tokenizer as tokenizer_lib
from disttrain.data.batches import TrainIterator
from disttrain.hf import adapters, config as hf_config, saves, weights as hf
from disttrain.operating import callbacks as callbacks_lib, events, lease as lease_lib, metrics
from disttrain.operating import stragglers, timing, tracking, watchdog
from disttrain.parallel import distributed, failures, mesh as mesh_lib
from disttrain.parallel import sharding as sharding_lib
from disttrain.parallel import state as state_lib
from disttrain.storage import checkpoint, checkpoint_reads, urls
from disttrain.training import memory, setup as run_lib, step_loop
from disttrain.training.actions import evaluate
from disttrain.training.setup import Setup, setup
from disttrain.training.step_loop import Result

__all__ = ['Result', 'Setup', 'evaluate', 'setup', 'train']


def train(cfg: Config, workdir: str, model: Any = None, task: Any = None,
          devices: Sequence[jax.Device] | None = None, tx: Any = None,
          train_step: Callable | None = None, *, eval_step: Callable | None = None,
          train_data: Any = None, eval_data: Any = None, callbacks: Sequence[Any] = (),
          rewards: Sequence[Any] | None = None,
          eval_extract: Callable[[str], str] | None = None) -> Result:
  """Trains `model` (default: the one cfg.model names) per `cfg`, writing outputs to `workdir`.

  Levels of disclosure: the config alone; your own data (`train_data`, `eval_data`: any source of
  feature dicts, see disttrain.data.records), `model` (any front end in disttrain.models) and `task`
  (per-example loss and metrics); your own optax `tx`, `train_step(ctx, state, batch) -> (state,
  metrics)` and `eval_step(ctx, state, batch) -> masked sums` (see step.StepContext); callbacks
  (see disttrain.operating.callbacks); `rewards`: GRPO's reward functions (data.name='prompts',
  when grpo.rewards names none); `eval_extract`: the answer extraction of data.eval_tasks'
  generation tasks (text -> str; default GSM8K's, disttrain/evaluation/metrics.py). Sharding,
  data, checkpoints and logging stay the same.
  Resumes from the newest complete checkpoint in `workdir` if there is one. `devices` defaults
  to every device of every process. Raises NonFiniteError on a NaN/Inf loss or gradient norm,
  Preempted after saving on SIGTERM and Interrupted after saving on Ctrl-C. `workdir` is a local directory or a
  bucket URL (gs://BUCKET/PATH, s3://BUCKET/PATH; disttrain/storage/urls.py). In a multi-process
  job, an error on one process is posted to the others before it is raised; they exit with the
  launcher's status for it (disttrain/parallel/failures.py). Every process raises a
  NonFiniteError or a Preempted itself, at the same step.
  """
  # In a multi-process program of the user's, another process's failure ends this one, and this
  # one's reaches the others before it is raised (`disttrain train`'s watch covers its whole run).
  watch = None if failures.watching() else failures.Watch()
  try:
    return _in_workdir(cfg, workdir, model, task, devices, tx, train_step, eval_step, train_data,
                       eval_data, callbacks, rewards, eval_extract)
  except BaseException as e:
    failures.hold_if_leaving()  # the echo of another's failure: the watch is taking this out
    # Not for a stop every process makes at the same step: a NaN in the global loss, a
    # preemption. Posted, it could take out a process still on its way to raising it, leaving
    # this one's last dispatched step (a collective) unmatched: its exit then hangs for good.
    if watch is not None and not isinstance(e, (disttrain.Preempted, errors.NonFiniteError)):
      failures.post(f'{type(e).__name__}: {e}', errors.exit_status(e))
    raise
  finally:
    if watch is not None:
      watch.close()


def _in_workdir(cfg, workdir, model, task, devices, tx, train_step, eval_step, train_data,
                eval_data, callbacks, rewards, eval_extract) -> Result:
  """train() within its workdir: the lease, the attempt's events, the run."""
  cfg = hf_config.from_directory(cfg)  # model.name='hf': the model restore_from's config.json
  workdir = urls.resolve(workdir)
  if urls.is_bucket(workdir) and jax.process_index() == 0:
    urls.check_writable(workdir)  # a missing bucket or credentials: one line, before the run
  log = events.EventLog(workdir, enabled=jax.process_index() == 0)
  # Before anything touches the workdir: another live run there keeps it (operating/lease.py).
  lease = lease_lib.Lease(workdir, cfg.lease_seconds if jax.process_index() == 0 else 0,
                          log.attempt)
  phases = timing.Phases()  # here: an attempt that fails reports its time too (goodput)
  with phases('setup'):  # waiting out a dead holder's lease (up to lease_seconds) counted nowhere
    lease.acquire()

  def peer_failed(process: int) -> None:  # its exit skips the handlers below: their work here
    if log.started:  # the step reached: goodput divides the step seconds by the steps
      reached = {'step': phases.last_step} if phases.last_step is not None else {}
      log.emit('end', error='PeerFailed', process=process, breakdown=phases.breakdown(),
               **reached)
    lease.release()
  try:
    with failures.on_leave(peer_failed):
      result = _train(cfg, workdir, log, model, task, devices, tx, train_step, eval_step,
                      train_data, eval_data, callbacks, rewards, eval_extract, phases)
  except BaseException as e:
    # Not for bad input found before the workdir was opened, nor for the echo of another
    # process's failure (a collective it broke): peer_failed says that one.
    if log.started and not failures.leaving():
      step = getattr(e, 'step', phases.last_step)
      log.emit('end', error=type(e).__name__, breakdown=phases.breakdown(),
               **({'step': step} if step is not None else {}))
    raise
  finally:
    lease.release()
  log.emit('end', step=result.step, stopped_by=result.stopped_by, breakdown=result.time)
  return result


def _train(cfg, workdir, log, model, task, devices, tx, train_step, eval_step, train_data,
           eval_data, callbacks, rewards, eval_extract, phases: timing.Phases) -> Result:
  with phases('setup'):
    run = setup(cfg, model, task, devices, tx, train_step, eval_step, train_data, eval_data,
                rewards, eval_extract)
    throughput = run_lib.throughput(run)
  tracking.quiet_libraries()
  writer = metrics.Writer(workdir, enabled=jax.process_index() == 0)
  hf_saves = saves.RunSaves(cfg, run.model, workdir, tokenizer_lib.load(cfg.data.tokenizer)
                            if cfg.hf_save_every_steps else None, writer.print)
  log.start(jax.process_count())
  info = run_lib.run_info(run)
  writer.write_run(info)
  evals = ', '.join(f'{len(r)} {name}' for name, r in run.eval_data.items()) or 'no eval'
  writer.print(f'disttrain: {run.mesh.size} devices, mesh {mesh_lib.axis_sizes(run.mesh)}, '
               f'step_mode={cfg.step_mode}, '
               f'{sharding_lib.describe_split(info["param_split"])}, data='
               f'{cfg.data.name if train_data is None else run.train_data.kind} '
               f'({len(run.train_data)} train / {evals})')
  hooks = callbacks_lib.Callbacks([*callbacks, *callbacks_lib.from_config(cfg.early_stop),
                                   *tracking.from_config(cfg, workdir, writer.local)])
  with contextlib.ExitStack() as stack:  # closed in reverse: saves commit before the writer goes
    stack.callback(writer.close)
    stack.enter_context(failures.on_leave(lambda _: writer.close()))  # a bucket's records too
    ckpt = checkpoint.Checkpointer(workdir, cfg)
    stack.callback(ckpt.close)  # waits for async saves to commit (and raises their errors)
    sampler = run.rollout  # GRPO reads prompts, one batch a dispatch, whole on every device
    batches = TrainIterator(run.train_data,
                            sampler.prompts_per_step if sampler else cfg.global_batch_size,
                            cfg.seed, sampler.prompt_sharding if sampler else run.batch_sharding,
                            prefetch=cfg.data.prefetch,
                            batches_per_element=1 if sampler else cfg.steps_per_dispatch,
                            workers=cfg.data.workers)
    stack.callback(batches.close)
    signals = distributed.StopSignals()
    stack.callback(signals.close)
    early = {}

    def preflight_fresh():  # the fresh state has the restored one's shapes and shardings
      if cfg.step_mode != 'pmap':
        with phases('compile'):
          early['compiled'] = memory.preflight(run, run.state, memory.loop_variants(cfg, 0),
                                                writer.print)
    with phases('setup'):
      restored_meta = {}
      state = _restore_or_init(ckpt, run, batches, hooks, writer, preflight_fresh, restored_meta)
    run.state = None  # donated to the first step: never touch it again
    first_step = int(jax.device_get(state.step))
    if first_step % cfg.steps_per_dispatch and first_step < cfg.num_train_steps:
      # GRPO's data position counts sampled batches, so the iterator's own check passes.
      raise errors.ConfigError(f'the checkpoint is at step {first_step}, not a multiple of '
                               f'steps_per_dispatch={cfg.steps_per_dispatch} (grpo.iterations); '
                               'resume with the value it was saved with, or one that divides '
                               'the step')
    # Records of steps after it, from an attempt killed before its next checkpoint, step aside.
    lost_through = writer.start(first_step)
    if first_step or lost_through is not None:
      log.emit('restore', step=first_step, trained_through=lost_through,
               tier=ckpt.restored_from if first_step else None)
    device_state = run.steps.place(state)
    del state
    with phases('compile'):
      info['compiled'], info['memory_limit_bytes'] = early.get('compiled') or memory.preflight(
          run, device_state, memory.loop_variants(cfg, first_step), writer.print)
    info['compiled'] = {k: v.to_json() for k, v in info['compiled'].items()}
    writer.write_run(info)
    guard = watchdog.Watchdog(watchdog.default_seconds(cfg.watchdog_seconds), phases, workdir)
    stack.callback(guard.close)
    acts = step_loop.Actions.build(run, workdir=workdir, ckpt=ckpt, batches=batches,
                                   signals=signals, hooks=hooks, writer=writer, phases=phases,
                                   throughput=throughput, hf_saves=hf_saves)
    acts.records.restore(restored_meta.get('train_window', []))
    acts.records.stragglers = stragglers.Monitor.start(jax.process_count(), jax.process_index(),
                                                       writer.print, log.emit)
    if acts.records.stragglers is not None:
      stack.callback(acts.records.stragglers.close)
    stack.callback(acts.profiler.close)  # a trace left open by an error
    mixed = getattr(run.train_data, 'scheduled', False)
    if mixed:
      info['data']['train']['mixture'] = run.train_data.totals(first_step)
    log.emit('training', step=first_step)  # set-up, restore and compilation are done
    result = step_loop.train_steps(run, first_step, device_state, batches, acts, phases,
                                   restored_meta.get('stopped_by'))
    if mixed:  # rows, tokens and epochs per source, through the last step trained
      info['data']['train']['mixture'] = run.train_data.totals(result.step)
    info['time'] = result.time
    info['stopped_by'] = result.stopped_by
    writer.write_run(info)
  hooks.call('on_end', result)
  return result


def _restore_or_init(ckpt, run: Setup, batches, hooks, writer, before_weights=lambda: None,
                     restored_meta: dict | None = None):
  """The newest checkpoint of this workdir, else a warm start from restore_from, else the fresh
  state; the data position and the callbacks' state come back with a checkpoint.
  `before_weights` runs before a Hugging Face directory's weights are read (the memory
  pre-flight: a model that cannot train here is refused before a download-sized read)."""
  cfg, state = run.cfg, run.state
  restored_meta = {} if restored_meta is None else restored_meta  # filled on a restore
  abstract = checkpoint.abstract_like(run.layout.shardings, state)
  frozen = state_lib.has_frozen(state)
  if frozen:  # the frozen weights first (LoRA's base, DPO's reference): checkpoints hold none
    if not ckpt.steps():
      before_weights()
    base = adapters.load_base(cfg, run.model, abstract.mutable[state_lib.FROZEN])
    if base is not None:
      state = state_lib.with_frozen(state, base)
      writer.print(f'frozen weights: the Hugging Face model in {cfg.restore_from}'
                   + (f' ({cfg.lora.base_dtype}); adapters of rank {cfg.lora.rank} train'
                      if cfg.lora.rank else ' (the reference)'))
  restored = ckpt.restore_latest(abstract)
  if restored is not None:
    restored_state, data_state, meta, at = restored
    if frozen:
      restored_state = state_lib.with_frozen(restored_state, state.mutable[state_lib.FROZEN])
    batches.set_state(data_state)  # the data order continues exactly where it stopped
    hooks.restore(meta.get('callbacks', {}))
    restored_meta.update(meta)
    writer.print(f'resumed from step {at}: {ckpt.directory}/{at}' if ckpt.restored_from !=
                 'local' else f'resumed from step {at}: the fast tier in {ckpt.local.root}')
    if batches.changed:
      writer.print(batches.changed)
    return restored_state
  if cfg.lora.rank:  # the adapters start fresh on the base
    return state
  if frozen and cfg.restore_from:  # DPO: the policy starts as the reference it was read into
    writer.print(f'warm start: params from the Hugging Face model in {cfg.restore_from}; '
                 'optimizer, step and data order start fresh')
    return state.replace(params=jax.tree.map(jnp.copy, state.mutable[state_lib.FROZEN]))
  if cfg.restore_from and hf.is_hf_dir(cfg.restore_from):
    before_weights()
    params = hf.restore(cfg.restore_from, run.model, cfg.model, abstract.params)
    writer.print(f'warm start: params from the Hugging Face model in {cfg.restore_from}; '
                 'optimizer, step and data order start fresh')
    return state.replace(params=params)
  if cfg.restore_from:
    params, mutable, at = checkpoint_reads.restore_params(cfg.restore_from, abstract)
    writer.print(f'warm start: params from {cfg.restore_from} (step {at}); optimizer, step and '
                 'data order start fresh')
    return state.replace(params=params, mutable=mutable)
  return state

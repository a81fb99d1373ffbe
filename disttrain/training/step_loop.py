"""The loop over steps: what happens each step, in order (the profiler's window, the batch, GRPO's
sampling, the train step, the previous step's record, evals, the stop agreement, the checkpoint,
the Hugging Face save), and the Result a run leaves. training/loop.py builds the run it trains.
"""

import dataclasses

import jax
from jax.sharding import Mesh

import disttrain
from disttrain.config import Config
from disttrain.hf import adapters, saves
from disttrain.operating import callbacks as callbacks_lib, timing
from disttrain.parallel import mesh as mesh_lib
from disttrain.parallel import state as state_lib
from disttrain.training import actions, train_records
from disttrain.training.setup import Setup


@dataclasses.dataclass
class Result:
  """What a run leaves behind in memory (the files are in the workdir)."""
  state: state_lib.TrainState
  records: list[dict]  # the metrics.jsonl records, also on processes that do not write
  trace_count: int  # most traces of any train-step variant; 1 = each compiled once
  step: int = 0  # the step the run ended at
  stopped_by: str = ''  # '' when it ran to num_train_steps, else who stopped it and why
  time: dict = dataclasses.field(default_factory=dict)  # seconds and fractions per phase


def must_bound_in_flight(mesh: Mesh) -> bool:
  """Whether at most two steps may be in flight: XLA:CPU's in-process all-reduce deadlocks when
  many multi-device steps are queued on few cores (measured: aborts after a 40 s rendezvous
  timeout). Accelerators do not need this."""
  return mesh.devices.flat[0].platform == 'cpu' and mesh.size > 1


@dataclasses.dataclass
class Actions:
  """The periodic actions of one run (training/train_records.py, actions.py), in the order the
  loop calls them."""
  out: train_records.Output
  records: train_records.TrainRecords
  evaluator: actions.Evaluator
  stopper: actions.Stopper
  saver: actions.Saver
  profiler: actions.Profiler
  hf_saves: saves.RunSaves

  @classmethod
  def build(cls, run: Setup, *, workdir, ckpt, batches, signals, hooks, writer, phases,
            throughput, hf_saves) -> 'Actions':
    cfg = run.cfg
    out = train_records.Output(writer, [], hooks)
    records = train_records.TrainRecords(cfg, out, phases, run.lr_schedule, throughput,
                                         lambda: saver.last_saved(),
                                         getattr(run.train_data, 'shares', None))
    saver = actions.Saver(cfg, ckpt, run.steps, batches, hooks, phases,
                          lambda at: {**meta(cfg, run.mesh, at, hooks),
                                      'train_window': records.state(),
                                      'stopped_by': saver.stopped_by}, sync=writer.sync)
    return cls(out=out, records=records,
               evaluator=actions.Evaluator(cfg, run.steps, run.eval_data, run.batch_sharding, out,
                                           phases, run.downstream),
               stopper=actions.Stopper(signals, hooks), saver=saver,
               profiler=actions.Profiler(cfg, workdir, writer, phases), hf_saves=hf_saves)


def train_steps(run: Setup, first_step: int, device_state, batches, acts: Actions,
                phases: timing.Phases, resumed_stop: list | None = None) -> Result:
  """Train steps with their records, evals, checkpoints, stops and profile; the final Result.
  `resumed_stop`: the [who, why] of a callback that stopped the run at its checkpoint."""
  cfg, steps, writer = run.cfg, run.steps, acts.out.writer
  bound_in_flight = must_bound_in_flight(run.mesh)
  if bound_in_flight:  # the program that made (or restored) the state has finished everywhere
    jax.block_until_ready(device_state)
  acts.records.start(first_step)
  phases.finished(first_step)
  step_no, previous, stop = first_step, None, None
  k = cfg.steps_per_dispatch  # every cadence is a multiple of K: K steps per compiled call
  # data.mixture_exhausted='stop': the last step before a source would repeat (None: never).
  data_end = getattr(run.train_data, 'last_step', lambda *_: None)(cfg.num_train_steps, k)
  data_stop = actions.StopRequest('callback', 'data', 'a mixture source has given every row '
                                  "(data.mixture_exhausted='stop')")
  if data_end is not None and first_step >= data_end:  # relaunched there: not one step more
    stop = data_stop
  if resumed_stop and first_step < cfg.num_train_steps and set(resumed_stop[0].split(', ')) & {
      callbacks_lib.Callbacks.name(c) for c in acts.stopper.hooks.callbacks}:
    stop = actions.StopRequest('callback', *resumed_stop)  # the callback stopped it: relaunched
  if first_step and acts.hf_saves.missing(first_step, first_step >= cfg.num_train_steps or (
      stop is not None and stop.kind == 'callback')):  # killed while writing it
    with phases('checkpoint'):
      acts.hf_saves.save(first_step, adapters.plain_params(run.model, steps.export(device_state)))
  for step_no in range(first_step + k, cfg.num_train_steps + 1 if stop is None else 0, k):
    last = step_no == cfg.num_train_steps
    acts.profiler.maybe_start(step_no)
    with phases('data'):
      batch = next(batches)
    sampled = {}
    if run.rollout is not None:  # GRPO: completions of the prompts, scored, become the batch
      with phases('sample'):
        batch, sampled = run.rollout(device_state, batch, step_no, lambda: phases('compile'))
    with phases('step'):
      device_state, step_metrics = steps.train(device_state, batch, acts.records.variant(step_no))
      if bound_in_flight and previous is not None:
        jax.block_until_ready(previous)  # at most two multi-device steps in flight (see above)
    previous = step_metrics
    step_metrics = {**step_metrics, **sampled}
    acts.records.per_batch.update(sampled)
    emitted = len(acts.out.records)
    acts.records.maybe_write(step_no, step_metrics)  # the previous step's record, fetched now
    acts.profiler.maybe_stop(step_no, device_state)
    eval_due = last or (cfg.eval_every_steps and step_no % cfg.eval_every_steps == 0)
    save_due = last or (cfg.checkpoint_every_steps and step_no % cfg.checkpoint_every_steps == 0)
    hf_due = acts.hf_saves.due(step_no, last)
    if eval_due or save_due or hf_due:
      acts.records.flush()  # every step up to here is checked finite before anything is saved
    evals = acts.evaluator.maybe_eval(step_no, device_state, force=last)
    # Records and evals are emitted at the same steps on every process: a matched agreement.
    stop = acts.stopper.maybe_stop(step_no, hooks_ran=len(acts.out.records) > emitted)
    if last and stop is not None and stop.kind in ('interrupted', 'preempted'):
      stop = None  # a signal during the last step's eval: the run is done, its last save follows
    if stop is None and data_end is not None and step_no >= data_end:  # the same on every process
      stop = data_stop
    if stop is not None:
      acts.records.flush()
      if stop.kind == 'callback':  # a callback ends training here: a final eval as at the end
        evals = acts.evaluator.maybe_eval(step_no, device_state, force=True) or evals
    if stop is not None and stop.kind == 'callback' and stop is not data_stop:
      acts.saver.stopped_by = [stop.who, stop.why]  # a relaunch stops there again
    # Metrics only where an eval ran at this step: a preemption save carries none (keep-best
    # would otherwise rank it by an older state's eval and drop the state evaluated).
    exported = acts.saver.maybe_save(step_no, device_state, force=last or stop is not None,
                                     evals=acts.evaluator.checkpoint_metrics() if evals else None)
    # A callback's stop ends the run normally: its last step is exported as the last step is.
    if hf_due or (stop is not None and stop.kind == 'callback'
                  and acts.hf_saves.due(step_no, True)):
      with phases('checkpoint'):
        if exported is None:
          exported = steps.export(device_state)
          acts.saver.check_finite(step_no, exported)
        acts.hf_saves.save(step_no, adapters.plain_params(run.model, exported))
    del exported  # released here: held to the next step its release fell outside every phase
    phases.finished(step_no)
    if stop is not None:
      break
  acts.profiler.maybe_stop(step_no, device_state, force=True)
  if stop is not None and stop.error(step_no, acts.saver.ckpt.directory) is not None:
    with phases('checkpoint'):
      acts.saver.ckpt.wait()  # the checkpoint must have committed before the process exits
    raise stop.error(step_no, acts.saver.ckpt.directory)
  if first_step >= cfg.num_train_steps:
    writer.print(f'already at step {first_step} of {cfg.num_train_steps}: nothing to train')
    acts.evaluator.maybe_eval(first_step, device_state, force=True)
  with phases('checkpoint'):
    acts.saver.ckpt.wait()  # the last save commits inside the measured time
  stopped_by = ''
  if stop is not None:
    stopped_by = f'{stop.who}: {stop.why}' if stop.why else stop.who
    go_on = ("relaunch with data.mixture_exhausted='repeat' to go on into its second epoch"
             if stop is data_stop else 'a relaunch stops here again; drop the callback (early '
             "stopping: early_stop.metric='') and relaunch to train on")
    writer.print(f'stopped at step {step_no} of {cfg.num_train_steps}: {stopped_by} (a checkpoint '
                 f'was saved: {go_on})')
  time = phases.breakdown()
  last_evals = acts.evaluator.last
  final = last_evals.get('eval') or next(iter(last_evals.values()), None)
  result_line = (f'final eval {actions.summary(final)} ({final["num_examples"]} examples)'
                 if final else 'no eval data')
  writer.print(f'done: {step_no - first_step} steps in {time["wall_seconds"]:.1f}s on '
               f'{run.mesh.size} devices {mesh_lib.axis_sizes(run.mesh)}; time: '
               f'{timing.summary(time)}; {result_line}; outputs in {writer.workdir}')
  return Result(state=steps.export(device_state), records=acts.out.records,
                trace_count=steps.trace_count, step=step_no, stopped_by=stopped_by, time=time)


def meta(cfg: Config, mesh: Mesh, step_no: int, hooks) -> dict:
  """Run metadata stored with each checkpoint (the callbacks' state among it)."""
  return {'step': step_no, 'config': cfg.to_dict(), 'mesh': mesh_lib.axis_sizes(mesh),
          'num_processes': jax.process_count(), 'disttrain_version': disttrain.__version__,
          'callbacks': hooks.states()}

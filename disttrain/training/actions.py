"""The loop's periodic actions, each a small object with one `maybe_...(step, ...)` entry.

  Evaluator     evaluates every eval source exactly once per eval (padded + masked), and
                the downstream tasks of data.eval_tasks (disttrain/evaluation/)
  Saver         checks the parameters finite and starts an async checkpoint
  Stopper       SIGTERM, Ctrl-C and callback stop requests, agreed across processes
  Profiler      a jax.profiler trace of a window of steps
The loop (training/step_loop.py) calls them in order each step, after the train records
(training/train_records.py); callbacks hang off records, Evaluator and Saver.
"""

import dataclasses
import glob
import os
from typing import Callable

import jax
import numpy as np

from disttrain.config import Config
from disttrain.data.batches import TrainIterator, eval_batches
from disttrain.data.records import Records
from disttrain.errors import ConfigError, Interrupted, NonFiniteError, Preempted
from disttrain.operating import metrics, timing
from disttrain.operating.callbacks import Callbacks
from disttrain.parallel import distributed, optim, step as step_lib
from disttrain.parallel.compiled import Steps
from disttrain.storage import checkpoint, urls
from disttrain.training.train_records import Output


def evaluate(steps: Steps, state, records: Records, batch_size: int, batch_sharding,
             beat: Callable[[], None] = lambda: None) -> dict[str, float]:
  """Every metric over every example of `records` exactly once (the last batch padded, masked)."""
  totals: dict[str, float] = {}
  pending = None

  def add(sums) -> None:
    for k, v in jax.device_get(sums).items():
      totals[k] = totals.get(k, 0.0) + float(v)
    beat()
  for batch in eval_batches(records, batch_size, batch_sharding):
    sums = steps.evaluate(state, batch)
    if pending is not None:  # fetch one batch late: the device stays busy, <= 2 in flight
      add(pending)
    pending = sums
  add(pending)
  count = totals.pop('count')
  examples = totals.pop('num_examples', count)
  tokens = totals.pop('num_tokens', None)
  out = {k: v / count for k, v in totals.items()}
  out['num_examples'] = int(examples)
  if tokens is not None:  # a per-token task: the loss is nats per counted token
    out['num_tokens'] = int(tokens)
    if 'loss' in out:
      out['perplexity'] = float(np.exp(min(out['loss'], 700.0)))
  return out


class Evaluator:
  """Evaluates each eval source every eval_every_steps, at the end, and when asked to."""

  def __init__(self, cfg: Config, steps: Steps, sources: dict[str, Records], batch_sharding,
               out: Output, phases: timing.Phases, tasks: Callable | None = None):
    self.cfg, self.steps, self.sources, self.out = cfg, steps, sources, out
    self.tasks = tasks  # evaluation.Downstream: state -> {task name: result}, or None
    self.batch_sharding, self.phases = batch_sharding, phases
    self.last: dict[str, dict] = {}  # split -> the latest eval result
    self.at = None  # the step of the latest eval

  def maybe_eval(self, step_no: int, device_state, force: bool = False) -> dict | None:
    """{split: result} if an eval is due at step_no (or forced) and not done there yet."""
    due = force or (self.cfg.eval_every_steps and step_no % self.cfg.eval_every_steps == 0)
    if not due or not (self.sources or self.tasks) or self.at == step_no:
      return None
    state = self.steps.export(device_state)
    ema = optim.ema_params(state.opt_state) if self.cfg.ema_eval else None
    if ema is not None:  # the moving average (ema_decay), sharded as the parameters
      state = state.replace(params=ema)
    with self.phases('eval'):
      results = {split: evaluate(self.steps, state, records, self.cfg.eval_batch,
                                 self.batch_sharding, self.phases.beat)
                 for split, records in self.sources.items()}
      if self.tasks is not None:  # the downstream tasks, on the same (EMA) parameters
        results.update(self.tasks(state, self.out.writer.print, self.phases.beat))
    self.at, self.last = step_no, results
    for split, result in results.items():
      self.out.emit({'step': step_no, 'split': split, **result}, 'on_eval')
      tokens = f', {result["num_tokens"]:,} tokens' if 'num_tokens' in result else ''
      self.out.writer.print(f'{split:<5} step {step_no}: {summary(result)} '
                            f'({result["num_examples"]} examples{tokens})')
    return results

  def checkpoint_metrics(self) -> dict | None:
    """The latest eval as {'val/accuracy': ...}, plus bare names for the default 'eval' source
    (best_metric='accuracy' predates named sources)."""
    if not self.last:
      return None
    flat = {f'{split}/{k}': v for split, result in self.last.items() for k, v in result.items()}
    flat.update(self.last.get('eval', {}))
    best = self.cfg.best_metric
    if best and best not in flat:  # else a KeyError inside orbax at the next save, every relaunch
      given = sorted(k for k in flat
                     if '/' in k and not k.endswith(('/num_examples', '/num_tokens')))
      raise ConfigError(f'best_metric={best!r} is not a metric of the eval, which gives {given}; '
                        'use one of them')
    return flat


def summary(result: dict) -> str:
  """'accuracy 0.9650, loss 0.1140': accuracy first when the task has it, then the rest."""
  names = sorted(k for k in result if k not in ('num_examples', 'num_tokens'))
  names.sort(key=lambda k: k != 'accuracy')
  return ', '.join(f'{k} {result[k]:.4f}' for k in names)


class Saver:
  """Checkpoints every checkpoint_every_steps, at the end and at a stop, and into the fast tier
  every local_checkpoint_every_steps; never a non-finite state."""

  def __init__(self, cfg: Config, ckpt: checkpoint.Checkpointer, steps: Steps,
               batches: TrainIterator, hooks: Callbacks, phases: timing.Phases,
               meta: Callable[[int], dict], sync: Callable[[], None] = lambda: None):
    self.cfg, self.ckpt, self.steps, self.batches = cfg, ckpt, steps, batches
    self.hooks, self.phases, self.meta, self.sync = hooks, phases, meta, sync
    self.stopped_by = None  # [who, why] of a callback's stop, saved in the checkpoint's meta

  def last_saved(self) -> str:
    """'the last checkpoint is step N in DIR' or 'there is no checkpoint yet in DIR'."""
    self.ckpt.wait()  # a save still committing is the last good checkpoint too
    saved = self.ckpt.steps()
    if not saved:
      return f'there is no checkpoint yet in {self.ckpt.directory}'
    return f'the last checkpoint is step {saved[-1]} in {self.ckpt.directory}'

  def check_finite(self, step_no: int, exported) -> None:
    """Raises unless every parameter is finite: grad_norm is only computed on logged steps, so
    the parameters themselves are checked before any save (checkpoint or Hugging Face)."""
    with self.phases('step'):  # the check waits for the steps still running
      finite = bool(step_lib.params_finite(exported.params))
    if not finite:
      raise NonFiniteError(f'step {step_no}: the parameters are not finite (the losses up to '
                           f'here were); that state was not saved, {self.last_saved()}; lower '
                           'learning_rate')

  def maybe_save(self, step_no: int, device_state, force: bool = False,
                 evals: dict | None = None):
    """Saves when due; returns the exported state it checked finite (None: nothing was due), so
    a Hugging Face save at the same step exports and checks it once."""
    due = force or (self.cfg.checkpoint_every_steps
                    and step_no % self.cfg.checkpoint_every_steps == 0)
    local = self.cfg.local_checkpoint_every_steps
    if not due and not (local and step_no % local == 0):
      return None
    with self.phases('checkpoint'):
      exported = self.steps.export(device_state)
      self.check_finite(step_no, exported)
      if not due:  # the fast tier only: each process's own disk (storage/local_tier.py)
        self.ckpt.save_local(step_no, exported, self.batches.get_state(), self.meta(step_no))
        self.sync()  # a resume from it keeps the bucket's records, which must reach its step
        return exported
      self.ckpt.save(step_no, exported, self.batches.get_state(), self.meta(step_no),
                     metrics=evals)
      self.sync()  # a bucket workdir's records reach the bucket with each checkpoint
    self.hooks.call('on_checkpoint', step_no, urls.join(self.ckpt.directory, str(step_no)))
    return exported


@dataclasses.dataclass(frozen=True)
class StopRequest:
  """Why the loop stops before num_train_steps."""
  kind: str  # 'preempted' (SIGTERM), 'interrupted' (Ctrl-C) or 'callback'
  who: str = ''
  why: str = ''

  def error(self, step: int, directory: str) -> Exception | None:
    """The exception that ends the run (None: a callback's stop ends it normally)."""
    if self.kind == 'interrupted':
      return Interrupted(step, directory)
    if self.kind == 'preempted':
      return Preempted(step, directory)
    return None


class Stopper:
  """Turns signals and callback requests into one stop that every process takes at one step."""

  def __init__(self, signals: distributed.StopSignals, hooks: Callbacks):
    self.signals, self.hooks = signals, hooks

  def maybe_stop(self, step_no: int, hooks_ran: bool) -> StopRequest | None:
    """Call every step on every process; `hooks_ran`: a record or eval was emitted this step
    (the same steps on every process, so the agreement below is a matched collective)."""
    if self.signals.reached(step_no):
      return StopRequest('interrupted' if self.signals.interrupted else 'preempted')
    if not (self.hooks and hooks_ran):
      return None
    requests = self.hooks.take()
    if not distributed.any_process(bool(requests)):
      return None
    who = ', '.join(name for name, _ in requests) or 'a callback on another process'
    why = '; '.join(reason for _, reason in requests if reason)
    return StopRequest('callback', who, why)


class Profiler:
  """A jax.profiler trace of steps start..start+n-1 into DIR/plugins/profile (TensorBoard)."""

  def __init__(self, cfg: Config, workdir: str, writer: metrics.Writer, phases: timing.Phases):
    self.start, self.num = cfg.profile.start_step, cfg.profile.num_steps
    self.enabled = bool(self.num) and (cfg.profile.all_processes or jax.process_index() == 0)
    # Traces go where the writer writes (a bucket workdir's local mirror, uploaded after).
    self.workdir, self.writer, self.phases = writer.local, writer, phases
    self.k = cfg.steps_per_dispatch
    self.tracing = False

  def maybe_start(self, step_no: int) -> None:
    """Before dispatching the call that ends at step_no."""
    if self.enabled and not self.tracing and step_no - self.k < self.start <= step_no:
      with self.phases('profile'):
        jax.profiler.start_trace(self.workdir)
      self.tracing = True

  def close(self) -> None:
    """Ends a trace that an error interrupted (jax allows one trace at a time per process)."""
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False

  def maybe_stop(self, step_no: int, device_state, force: bool = False) -> None:
    """After dispatching the call that ends at step_no: stops once the window's steps ran."""
    if self.tracing and (force or step_no >= self.start + self.num - 1):
      with self.phases('step'):
        jax.block_until_ready(device_state)  # the traced steps' device work is in the trace
      with self.phases('profile'):
        jax.profiler.stop_trace()
      self.tracing = False
      runs = sorted(glob.glob(os.path.join(self.workdir, 'plugins', 'profile', '*')))
      where = os.path.relpath(runs[-1] if runs else os.path.join(self.workdir, 'plugins',
                                                                 'profile'), self.workdir)
      self.writer.sync()
      self.writer.print(f'profile: steps {self.start}-{step_no} traced into '
                        f'{urls.join(self.writer.workdir, where)} (tensorboard '
                        f'--logdir={self.writer.workdir}, Profile tab)')

"""Train records: each step's metrics fetched one step late, checked finite, and written every
log_every_steps as one record (metrics.jsonl's train line, TensorBoard, console, callbacks)."""

import dataclasses
from typing import Callable

import jax
import numpy as np

from disttrain.config import Config
from disttrain.errors import NonFiniteError
from disttrain.operating import metrics, timing
from disttrain.operating.callbacks import Callbacks
from disttrain.parallel.step import Variant


@dataclasses.dataclass
class Output:
  """Where records go: metrics.jsonl/TensorBoard/console (process 0), the in-memory list."""
  writer: metrics.Writer
  records: list
  hooks: Callbacks

  def emit(self, record: dict, hook: str) -> None:
    self.records.append(record)
    self.writer.write(record)
    self.hooks.call(hook, record)


class TrainRecords:
  """Train records every log_every_steps: the mean loss of the window, the last step's metrics.

  Step N's metrics are fetched after step N + 1 is dispatched, so logging never leaves the
  device idle; `flush` fetches what is pending before anything is saved or evaluated.
  """

  def __init__(self, cfg: Config, out: Output, phases: timing.Phases, lr_schedule: Callable,
               throughput: metrics.Throughput, last_saved: Callable[[], str],
               shares: Callable[[int, int], dict] | None = None):
    self.cfg, self.out, self.phases, self.shares = cfg, out, phases, shares
    self.lr_schedule, self.throughput, self.last_saved = lr_schedule, throughput, last_saved
    self.k = cfg.steps_per_dispatch
    self._variants = {logged: Variant(metrics=logged, steps=self.k, full_batch=True)
                      for logged in (True, False)}
    self.window: list = []  # [(first step, last step, metrics)] since the last record
    self.due = None  # the window of a record not yet written
    self._mark = None  # (step, active seconds, data seconds) at the previous record
    self.stragglers = None  # operating.stragglers.Monitor of a multi-process job
    self.per_batch: set[str] = set()  # GRPO's sampler figures, one per sampled batch

  def variant(self, step_no: int) -> Variant:
    """Every metric on steps that end a record, the loss alone in between (full batches)."""
    return self._variants[step_no % self.cfg.log_every_steps == 0
                          or step_no == self.cfg.num_train_steps]

  def start(self, step_no: int) -> None:
    self._mark = (step_no, self.phases.active(), self.phases.seconds['data'])

  def state(self) -> list:
    """The steps since the last record, for a checkpoint: a run resumed between records writes
    the next one over the same steps as an uninterrupted run."""
    self.flush()
    return [[at, {k: float(v) for k, v in m.items()}] for at, _, m in self.window]

  def restore(self, window: list) -> None:
    self.window = [(at, at, m) for at, m in window]

  def maybe_write(self, step_no: int, step_metrics: dict) -> None:
    """Writes the record due at the previous step, then adds this step's metrics."""
    if self.due is not None:
      with self.phases('records'):
        self._write(self.due)
      self.due = None
    self.window.append((step_no - self.k + 1, step_no, step_metrics))
    if self.variant(step_no).metrics:
      self.due, self.window = self.window, []

  def flush(self) -> None:
    """Writes a pending record and checks the steps since it finite (fetching them)."""
    with self.phases('records'):
      if self.due is not None:
        self._write(self.due)
        self.due = None
      self.window = self._checked(self.window)

  def _checked(self, window: list) -> list:
    """Fetches [(first, last step, metrics)] as one entry per step; a non-finite step stops the
    run."""
    with self.phases('step'):  # waits for the steps still running: step time, not records'
      # np.asarray per metric: jax.device_get's per-leaf async copies cost ~10x more (measured).
      fetched = [(first, last, jax.tree.map(np.asarray, m)) for first, last, m in window]
    flat = []
    for first, last, m in fetched:
      if first == last:
        flat.append((last, last, m))
        continue
      # One dispatch of K steps: per-step metrics have a leading [K] axis, the rest (scalars)
      # belong to its last step.
      per_step = [k for k, v in m.items() if np.ndim(v) == 1]
      for i, at in enumerate(range(first, last + 1)):
        entry = {k: m[k][i] for k in per_step}
        if at == last:
          entry.update((k, v) for k, v in m.items() if k not in per_step)
        flat.append((at, at, entry))
    for at, _, m in flat:
      m.setdefault('count', self.cfg.global_batch_size)  # quiet steps: full batches
      checked = {k: float(m[k]) for k in ('loss', 'grad_norm') if k in m}
      if not all(np.isfinite(v) for v in checked.values()):
        values = ' '.join(f'{k}={v}' for k, v in checked.items())
        raise NonFiniteError(
            f'step {at}: {values} is not finite; that state was not saved, {self.last_saved()}; '
            'lower learning_rate or check the data (a target outside the model\'s classes also '
            'gives a NaN loss)')
    return flat

  def _write(self, window: list) -> None:
    window = self._checked(window)
    at = window[-1][1]
    if self.stragglers is not None:  # every process, at the same records
      self.stragglers.note(at, self.phases.seconds['data'])
    first, active, waited = self._mark
    seconds = max(self.phases.active() - active, 1e-9)
    data_seconds = self.phases.seconds['data'] - waited
    self._mark = (at, self.phases.active(), self.phases.seconds['data'])
    examples_per_sec = (at - first) * self.cfg.global_batch_size / seconds
    record = _train_record(at, [m for _, _, m in window], float(self.lr_schedule(at - 1)),
                           self.per_batch)
    record.update(examples_per_sec=examples_per_sec,
                  data_wait_fraction=round(min(data_seconds / seconds, 1.0), 4),
                  **self.throughput.fields(examples_per_sec))
    if self.shares is not None:  # a mixture: each source's share of the record's rows (a
      record.update(self.shares(window[0][0] - 1, at))  # resume restores them; `first` is later)
    self.out.emit(record, 'on_train_record')
    eta = (self.cfg.num_train_steps - at) * seconds / max(at - first, 1)
    self.out.writer.print(f'train step {at}/{self.cfg.num_train_steps}: loss {record["loss"]:.4f} '
                          f'{examples_per_sec:,.0f} examples/s, ETA {metrics.format_eta(eta)}')


def _train_record(step: int, window: list[dict], lr: float,
                  per_batch: frozenset[str] | set[str] = frozenset()) -> dict:
  """A train record over the steps since the last one.

  Metrics every step reports ('loss', and with the default step the task's metrics) are averaged
  over those global batches, weighted by count; the others (grad_norm) are the last step's.
  `per_batch` figures (a sampled batch's reward, lengths, times) are their steps' plain mean, a
  `_max` their largest: each step samples as many completions, whatever their tokens.
  """
  counts = np.array([float(m['count']) for m in window])
  record = {'step': step, 'split': 'train'}
  every_step = set(window[0]).intersection(*window[1:])
  for key, value in window[-1].items():
    if key == 'count':
      continue
    if key in per_batch:
      values = [float(m[key]) for m in window if key in m]
      record[key] = max(values) if key.endswith('_max') else float(np.mean(values))
    elif key in every_step:
      record[key] = float(np.sum([float(m[key]) for m in window] * counts) / counts.sum())
    else:
      record[key] = float(value)
  record.setdefault('grad_norm', 0.0)  # a custom step without one: the field is always there
  record['learning_rate'] = lr
  return record

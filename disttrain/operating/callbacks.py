"""Callbacks: small objects whose hooks the loop calls on the host with records it already fetched.

Hooks (all optional; a callback needs only the ones it uses):
  on_train_record(record)    each train record (metrics.jsonl's train line), one step after it
  on_eval(record)            each eval record, one per eval source ('split': 'eval', 'val', ...)
  on_checkpoint(step, path)  after a checkpoint was started (async: it commits in the background)
  on_end(result)             once, with the Result, when the run ends normally or by a stop
  state() -> dict, restore(state)   JSON state saved in every checkpoint and restored on resume

A hook that returns STOP (or Stop('why')) asks the run to stop: every process stops at one
agreed step (that record's or eval's; on_checkpoint's: the next record's or eval's), a checkpoint
is saved there, and the run ends normally (exit status 0). Hooks run on
every process with the same records; hooks never see device arrays, so they add no host sync.
"""

import csv
import dataclasses
import json
import math
import os
from typing import Any

import jax

from disttrain.errors import ConfigError, DisttrainError, first_line

_HOOKS = ('on_train_record', 'on_eval', 'on_checkpoint', 'on_end')


@dataclasses.dataclass(frozen=True)
class Stop:
  """What a hook returns to ask the run to stop; `reason` is printed with the callback's name."""
  reason: str = ''


STOP = Stop()


class CallbackError(DisttrainError):
  """A callback's hook raised."""


class Callback:
  """Base class with empty hooks; subclassing is optional (hooks are looked up by name)."""

  def on_train_record(self, record: dict) -> Stop | None:
    del record

  def on_eval(self, record: dict) -> Stop | None:
    del record

  def on_checkpoint(self, step: int, path: str) -> None:
    del step, path

  def on_end(self, result: Any) -> None:
    del result


def _metric_name(metric: str) -> tuple[str, str]:
  """'val/accuracy' -> ('val', 'accuracy'); a bare 'accuracy' means the default eval source."""
  split, _, name = metric.rpartition('/')
  return split or 'eval', name


class EarlyStopping(Callback):
  """Stops when `metric` ('eval/accuracy', 'val/loss', ...) has not improved for `patience` evals.

  An eval improves when it beats the best so far by more than `min_delta` (larger for
  mode='max', smaller for 'min'). Its state (best, when, evals since) is saved in checkpoints, so
  a resumed run stops at the same step as an uninterrupted one.
  """

  def __init__(self, metric: str = 'eval/accuracy', mode: str = 'max', patience: int = 3,
               min_delta: float = 0.0):
    if mode not in ('max', 'min') or patience < 1 or min_delta < 0:
      raise ConfigError(f'EarlyStopping(mode={mode!r}, patience={patience}, min_delta='
                        f'{min_delta}): mode must be max or min, patience >= 1, min_delta >= 0')
    self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
    self.split, self.name = _metric_name(metric)
    self.best, self.best_step, self.since_best = None, None, 0

  def on_eval(self, record: dict) -> Stop | None:
    if record['split'] != self.split:
      return None
    if self.name not in record:
      fields = sorted(k for k in record if k not in ('step', 'split'))
      raise ConfigError(f'early-stopping metric {self.metric!r}: the {self.split} record has no '
                        f'{self.name!r} (it has {fields}); name one of them')
    value = float(record[self.name])
    sign = 1.0 if self.mode == 'max' else -1.0
    # A NaN never becomes the best: every comparison with it is False, so nothing would beat it.
    if math.isfinite(value) and (self.best is None or sign * (value - self.best) > self.min_delta):
      self.best, self.best_step, self.since_best = value, record['step'], 0
      return None
    self.since_best += 1
    if self.since_best >= self.patience:
      best = 'no finite value' if self.best is None else \
          f'best {self.best:.6g} at step {self.best_step}'
      return Stop(f'{self.metric} has not improved by more than {self.min_delta} for '
                  f'{self.since_best} evals ({best})')
    return None

  def state(self) -> dict:
    return {'best': self.best, 'best_step': self.best_step, 'since_best': self.since_best}

  def restore(self, state: dict) -> None:
    self.best, self.best_step = state['best'], state['best_step']
    self.since_best = state['since_best']


class CsvLogger(Callback):
  """Appends every train and eval record to a CSV file (process 0), one column per field.

  An example of a callback that only reads: the columns are the first record's fields plus
  any new field, rewritten in full as records come (records are few). A resumed run keeps the
  file's rows before its first record (those after the checkpoint are written again).
  """

  def __init__(self, path: str):
    self.path, self._rows, self._resumed = path, None, False

  def state(self) -> dict:
    return {}

  def restore(self, state: dict) -> None:
    del state
    self._resumed = True

  def _earlier(self, record: dict) -> list[dict]:
    """The file's rows before `record`, a step's train row before its eval (a finished run
    relaunched evaluates its last step again, after that step's train row)."""
    if not (self._resumed and os.path.exists(self.path)):
      return []
    order = lambda step, split: (int(step), split != 'train')
    with open(self.path, newline='', encoding='utf-8') as f:
      return [row for row in csv.DictReader(f)
              if order(row['step'], row['split']) < order(record['step'], record['split'])]

  def _add(self, record: dict) -> None:
    if jax.process_index() != 0:
      return
    if self._rows is None:
      self._rows = self._earlier(record)
    self._rows.append(record)
    fields = list(dict.fromkeys(k for row in self._rows for k in row))
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    with open(self.path, 'w', newline='', encoding='utf-8') as f:
      writer = csv.DictWriter(f, fieldnames=fields)
      writer.writeheader()
      writer.writerows(self._rows)

  def on_train_record(self, record: dict) -> None:
    self._add(record)

  def on_eval(self, record: dict) -> None:
    self._add(record)


def from_config(early_stop) -> list:
  """The callbacks a config asks for (early_stop.*)."""
  if not early_stop.metric:
    return []
  return [EarlyStopping(early_stop.metric, early_stop.mode, early_stop.patience,
                        early_stop.min_delta)]


class Callbacks:
  """Calls every callback's hook, names the callback and hook when one raises, collects stops."""

  def __init__(self, callbacks: list):
    self.callbacks = list(callbacks)
    self.requests: list[tuple[str, str]] = []  # (callback name, reason) since the last take()

  def __bool__(self) -> bool:
    return bool(self.callbacks)

  @staticmethod
  def name(callback: Any) -> str:
    return type(callback).__name__

  def call(self, hook: str, *args) -> None:
    """hook(*args) on every callback that has it, in order."""
    assert hook in _HOOKS, hook
    for callback in self.callbacks:
      fn = getattr(callback, hook, None)
      if fn is None:
        continue
      try:
        answer = fn(*args)
      except Exception as e:  # pylint: disable=broad-except
        raise CallbackError(f'callback {self.name(callback)}.{hook} raised {type(e).__name__}: '
                            f'{first_line(e)}; fix the callback (the last checkpoint is '
                            'kept)') from e
      if isinstance(answer, Stop):
        self.requests.append((self.name(callback), answer.reason))

  def take(self) -> list[tuple[str, str]]:
    """The stop requests made since the last call."""
    requests, self.requests = self.requests, []
    return requests

  def states(self) -> dict:
    """{'<index>:<class name>': state} of the callbacks that keep state (JSON, for checkpoints)."""
    out = {}
    for i, callback in enumerate(self.callbacks):
      state = getattr(callback, 'state', None)
      if state is not None:
        value = state()
        json.dumps(value, allow_nan=True)  # fail here, not inside an async save
        out[f'{i}:{self.name(callback)}'] = value
    return out

  def restore(self, states: dict) -> None:
    """Gives each callback its saved state (matched by position and class name)."""
    for i, callback in enumerate(self.callbacks):
      key = f'{i}:{self.name(callback)}'
      if key in states and hasattr(callback, 'restore'):
        callback.restore(states[key])


"""Weighted mixtures of sources that resume exactly: the sources, their weights and stages.

  data.mixture='web=data/web/*.bin:0.7;code=data/code/*.bin:0.3'   (weight after the last colon)
  data.mixture_stages='1000:web=0.5,code=0.5'                      new weights from step 1000 on
  Mixture({'web': src, 'code': src}, {'web': 0.7, 'code': 0.3})    the same from Python / get_data

Rows come from the sources by the deterministic schedule of disttrain/data/schedule.py, never a
random draw per row. Each source walks its own shuffled epochs (seed, source name, epoch), and
its random transforms draw from (seed, source name, epoch, index); adding a source leaves the
others' orders alone. The iterator state keeps each source's draw count, so a restart whose
weights differ from the checkpoint's (a new stage, an edited mixture) continues every source
where it stopped under the new weights.
"""

import dataclasses
import math
import re
import zlib
from typing import Any

import numpy as np

from disttrain.data.records import ID, Records
from disttrain.data.schedule import Schedule
from disttrain.errors import ConfigError, DataError

EXHAUSTED = ('repeat', 'stop')


@dataclasses.dataclass(frozen=True)
class Mixture:
  """Named sources drawn in proportion to `weights`; `stages`: [(from_step, {name: weight})].

  exhausted: 'repeat' (a source starts its next epoch, counted per source) or 'stop' (the run
  ends, with a checkpoint, at the last step whose rows every source still has unread).
  """
  sources: dict[str, Any]
  weights: dict[str, float]
  stages: tuple = ()
  exhausted: str = 'repeat'


def parse_sources(spec: Any) -> list[tuple[str, str, float]]:
  """'web=GLOB:0.7;code=GLOB:0.3' (or ((name, glob, weight), ...)) -> [(name, glob, weight)]."""
  if isinstance(spec, str):
    entries = []
    for part in filter(None, (p.strip() for p in spec.split(';'))):
      name, eq, rest = part.partition('=')
      pattern, colon, weight = rest.rpartition(':')
      if not (eq and colon and name.strip() and pattern):
        raise ConfigError(f'data.mixture entry {part!r} is not NAME=GLOB:WEIGHT; write e.g. '
                          "'web=data/web/*.bin:0.7;code=data/code/*.bin:0.3'")
      entries.append((name.strip(), pattern.strip(), _number(weight, f'data.mixture {part!r}')))
  elif isinstance(spec, (tuple, list)) and all(
      isinstance(e, (tuple, list)) and len(e) == 3 for e in spec):
    entries = [(str(n), str(p), _number(w, f'data.mixture entry {n!r}')) for n, p, w in spec]
  else:
    raise ConfigError(f'data.mixture={spec!r} is neither NAME=GLOB:WEIGHT;... nor a tuple of '
                      '(name, glob, weight); pass one of them')
  names = [n for n, _, _ in entries]
  bad = [n for n in names if not re.fullmatch(r'[A-Za-z0-9_.-]+', n) or n in ('train', 'eval')]
  if bad:
    raise ConfigError(f'data.mixture source name {bad[0]!r} must be letters, digits, _ . - and '
                      'not train or eval (it names records and an eval set); rename it')
  if len(names) < 1 or len(set(names)) != len(names):
    raise ConfigError(f'data.mixture names {names} must be distinct and at least one; rename '
                      'the repeated source')
  check_weights('data.mixture', {n: w for n, _, w in entries})
  return entries


def parse_stages(spec: Any, names: list[str]) -> list[tuple[int, dict[str, float]]]:
  """'1000:web=0.5,code=0.5;...' (or ((1000, {'web': 0.5, ...}), ...)) -> [(step, weights)]."""
  if isinstance(spec, str):
    stages = []
    for part in filter(None, (p.strip() for p in spec.split(';'))):
      step, colon, pairs = part.partition(':')
      pairs = [pair.split('=', 1) for pair in filter(None, (p.strip() for p in pairs.split(',')))]
      weights = dict(pair for pair in pairs if len(pair) == 2)
      names_given = [name.strip() for name, *_ in pairs]
      if (not colon or not weights or not step.strip().isdigit() or len(weights) < len(pairs)
          or len(set(names_given)) < len(names_given)):
        raise ConfigError(f'data.mixture_stages entry {part!r} is not STEP:NAME=WEIGHT,... '
                          "with each name once; write e.g. '1000:web=0.5,code=0.5'")
      stages.append((int(step), {k.strip(): _number(v, f'data.mixture_stages {part!r}')
                                 for k, v in weights.items()}))
  elif isinstance(spec, (tuple, list)) and all(
      isinstance(s, (tuple, list)) and len(s) == 2 and isinstance(s[1], dict) for s in spec):
    stages = [(_step(step), {str(k): _number(v, 'data.mixture_stages') for k, v in w.items()})
              for step, w in spec]
  else:
    raise ConfigError(f'data.mixture_stages={spec!r} is neither STEP:NAME=WEIGHT,...;... nor a '
                      'tuple of (step, {name: weight}); pass one of them')
  steps = [s for s, _ in stages]
  if steps != sorted(set(steps)) or (steps and steps[0] <= 0):
    raise ConfigError(f'data.mixture_stages steps {steps} must be positive and increasing (the '
                      'steps before the first use data.mixture\'s weights); sort them')
  for step, weights in stages:
    unknown = sorted(set(weights) - set(names))
    if unknown:
      raise ConfigError(f'data.mixture_stages step {step} names {unknown[0]!r}, not a source of '
                        f'data.mixture {names}; use those names')
    check_weights(f'data.mixture_stages step {step}', weights)
  return stages


def check_weights(field: str, weights: dict[str, float]) -> None:
  bad = {n: w for n, w in weights.items() if not (w >= 0 and math.isfinite(w))}
  if bad or not any(weights.values()):
    raise ConfigError(f'{field} weights {weights} must be >= 0 and not all 0; '
                      + (f'fix {next(iter(bad))!r}' if bad else 'give some source a weight'))


def _step(value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):  # '1k', None, 10.7
    raise ConfigError(f'data.mixture_stages step {value!r} is not a whole number; write e.g. '
                      '(1000, {"web": 0.5, "code": 0.5})')
  return int(value)


def _number(text: Any, where: str) -> float:
  try:
    return float(text)
  except (TypeError, ValueError):
    raise ConfigError(f'{where}: weight {text!r} is not a number; write e.g. 0.7') from None


class MixtureRecords:
  """The rows of a mixture as TrainIterator reads them: global row numbers in, examples out."""

  scheduled = True  # TrainIterator passes global row numbers, not shuffled indices
  uses_epochs = False  # each source counts its own

  def __init__(self, mixture: Mixture, batch_size: int, seed: int):
    if not mixture.sources:
      raise ConfigError('the mixture has no sources; give Mixture at least one')
    self.names = list(mixture.sources)
    self.parts = [Records(source, f'{name} (mixture source)', seed, (_key(name),))
                  for name, source in mixture.sources.items()]
    first = self.parts[0]
    for name, part in zip(self.names[1:], self.parts[1:]):
      if part.spec != first.spec:
        raise DataError(f'mixture sources {self.names[0]!r} and {name!r} give different rows '
                        f'({_describe(first.spec)} vs {_describe(part.spec)}); mix sources of one '
                        'kind, tokenizer and data.seq_len')
    self.spec, self.batch_size, self.seed = first.spec, batch_size, seed
    self.lengths = np.array([len(p) for p in self.parts], np.int64)
    self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
    if mixture.exhausted not in EXHAUSTED:
      raise ConfigError(f'data.mixture_exhausted={mixture.exhausted!r} is not one of {EXHAUSTED}')
    self.exhausted = mixture.exhausted
    weights = {n: _number(w, f'the mixture source {n!r}') for n, w in mixture.weights.items()}
    check_weights('the mixture', weights)
    stages = parse_stages(tuple(mixture.stages), self.names)  # a Mixture built in Python too
    # (first batch, weights): a stage from step S on starts at batch S - 1 (steps count from 1).
    self.stages = [(0, _vector(weights, self.names))] + [
        (step - 1, _vector(w, self.names)) for step, w in stages]
    self.origin = (0, np.zeros(len(self.names), np.int64))  # where the schedule starts
    self.schedule = self._schedule(*self.origin, self.stages)
    self._perms = {}

  def _schedule(self, batch: int, base: np.ndarray, stages: list) -> Schedule:
    """From global batch `batch` on, with `base` draws made: the stage in force there, then the
    later ones."""
    current = [w for b, w in stages if b <= batch][-1]
    later = [(b * self.batch_size, w) for b, w in stages if b > batch]
    return Schedule([(batch * self.batch_size, current)] + later, base)

  def __len__(self) -> int:
    return int(self.lengths.sum())

  @property
  def kind(self) -> str:
    return f'mixture of {", ".join(self.names)}'

  def _examples(self, s: int, draws: np.ndarray) -> np.ndarray:
    """Source s's example indices of its draws: its own shuffled epochs."""
    epochs, at = np.divmod(draws, self.lengths[s])
    out = np.empty_like(draws)
    for epoch in np.unique(epochs):
      key = (s, int(epoch))
      if key not in self._perms:
        if len(self._perms) > 4 * len(self.names):  # keep the current epochs only
          self._perms.clear()
        rng = np.random.default_rng([self.seed, _key(self.names[s]), int(epoch)])
        self._perms[key] = rng.permutation(self.lengths[s])
      out[epochs == epoch] = self._perms[key][at[epochs == epoch]]
    return out

  def read(self, rows: np.ndarray, epochs: Any = 0) -> dict[str, np.ndarray]:
    """Global rows -> their examples stacked, ID = offset of the source + index within it."""
    del epochs
    rows = np.asarray(rows, np.int64)
    source, draw = self.schedule.locate(rows)
    out = {k: np.empty((rows.size,) + s.shape, s.dtype) for k, s in self.spec.items()}
    ids = np.empty(rows.size, np.int64)
    for s in np.unique(source):
      at = source == s
      index = self._examples(int(s), draw[at])
      for key, value in self.parts[s].read(index, draw[at] // self.lengths[s]).items():
        out[key][at] = value
      ids[at] = self.offsets[s] + index
    out[ID] = ids.astype(np.int32)
    return out

  def rows_before(self, step: int) -> np.ndarray:
    """Rows each source gave to steps 1..step."""
    return self.schedule.draws_before(step * self.batch_size)

  def shares(self, first: int, last: int) -> dict[str, float]:
    """{'mixture/<name>': the fraction of the rows of steps first+1..last from that source}."""
    rows = (self.rows_before(last) - self.rows_before(first)) / max((last - first) *
                                                                    self.batch_size, 1)
    return {f'mixture/{n}': float(r) for n, r in zip(self.names, rows)}

  def totals(self, step: int) -> dict[str, dict]:
    """run.json's per-source rows, tokens (row positions) and epochs after `step` steps."""
    rows = self.rows_before(step)
    width = int(np.prod(self.spec['tokens'].shape)) if 'tokens' in self.spec else 0
    return {n: {'examples': int(size), 'rows': int(r), 'tokens': int(r) * width,
                'epochs': round(float(r / size), 4)}
            for n, size, r in zip(self.names, self.lengths, rows)}

  def last_step(self, num_steps: int, multiple: int = 1) -> int | None:
    """exhausted='stop': the last step (a multiple of `multiple`) before some source would start
    a second epoch, if that comes before num_steps; else None."""
    if self.exhausted != 'stop':
      return None
    fits = lambda step: bool(np.all(self.rows_before(step) <= self.lengths))
    if fits(num_steps):
      return None
    lo, hi = 0, num_steps  # fits(lo), not fits(hi)
    while hi - lo > 1:
      mid = (lo + hi) // 2
      lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    lo -= lo % multiple
    if lo == 0:
      short = self.names[int(np.argmax(self.rows_before(multiple) - self.lengths))]
      raise DataError(f'mixture source {short!r} has fewer rows than its share of the first '
                      "steps; give it more data or use data.mixture_exhausted='repeat'")
    return lo

  def get_state(self, next_batch: int) -> dict:
    """What a resume needs: the stages in force, each source's draws before next_batch, and
    where a changed mixture's schedule started (a later resume keeps it)."""
    state = {'names': self.names, 'examples': self.lengths.tolist(),
             'stages': [[s, w.tolist()] for s, w in self.stages],
             'draws': self.rows_before(next_batch).tolist()}
    if self.origin[0]:
      state['origin'] = [self.origin[0], self.origin[1].tolist()]
    return state

  def set_state(self, state: dict, next_batch: int) -> str:
    """Continues at next_batch; returns a line for the console when the weights changed."""
    saved = dict(zip(state['names'], state['examples']))
    for name, size in zip(self.names, self.lengths):
      if name in saved and saved[name] != size:
        raise DataError(f'mixture source {name!r} had {saved[name]} examples in the checkpoint '
                        f'but has {size} now; resume with the same files or start a new run')
    same = state['names'] == self.names and state['stages'] == [[s, w.tolist()]
                                                                for s, w in self.stages]
    if same:
      if 'origin' in state:  # changed at an earlier resume: that schedule goes on
        self.origin = (int(state['origin'][0]), np.array(state['origin'][1], np.int64))
        self.schedule = self._schedule(*self.origin, self.stages)
      return ''
    draws = dict(zip(state['names'], state['draws']))
    self.origin = (next_batch, np.array([draws.get(n, 0) for n in self.names], np.int64))
    base = self.origin[1]
    self.schedule = self._schedule(*self.origin, self.stages)
    return (f'data.mixture changed since the checkpoint: from step {next_batch + 1} the sources '
            f'{self.names} continue from rows {base.tolist()} with weights '
            f'{[round(float(x), 4) for x in [w for b, w in self.stages if b <= next_batch][-1]]}')


def train_records(source: Any, global_batch_size: int, seed: int) -> 'Records | MixtureRecords':
  """The records a run trains on: a Mixture's weighted draw, or one source's shuffle."""
  if isinstance(source, Mixture):
    return MixtureRecords(source, global_batch_size, seed)
  return Records(source, 'train', seed)


def _key(name: str) -> int:
  """A source's seed word: its shuffles and random transforms draw apart from the others'."""
  return zlib.crc32(name.encode())


def _vector(weights: dict[str, float], names: list[str]) -> np.ndarray:
  unknown = sorted(set(weights) - set(names))
  if unknown:
    raise ConfigError(f'mixture weights name {unknown[0]!r}, not one of the sources {names}')
  return np.array([float(weights.get(n, 0.0)) for n in names], np.float64)


def _describe(spec: dict) -> str:
  return ', '.join(f'{k} {s.dtype}{list(s.shape)}' for k, s in sorted(spec.items()))

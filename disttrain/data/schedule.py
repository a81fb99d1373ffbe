"""Which source each row of a mixture comes from: a smooth weighted round robin, by arithmetic.

One stage's weights become integer counts c_s per period P = sum(c) (exact for weights like 0.7 /
0.3: P = 10). Each row every source earns c_s credit and the richest pays P; with two sources this
is the balanced (Sturmian) word, so any L consecutive rows hold w L rows of a source rounded up or
down. A row's source and its draw number within that source are a table lookup and a division:
random access, as workers, processes and resumes need.
"""

import math
from fractions import Fraction

import numpy as np

_MAX_PERIOD = 100_000  # rows per period: weights are exact to 1e-5 at worst (largest remainder)


def _counts(weights: np.ndarray) -> np.ndarray:
  """Integer counts per period in the weights' proportions (a small exact period if there is one)."""
  shares = np.asarray(weights, np.float64) / np.sum(weights)  # relative: 7e-4 : 3e-4 is 0.7 : 0.3
  fractions = [Fraction(float(w)).limit_denominator(1000) for w in shares]
  total = sum(fractions)
  fractions = [f / total for f in fractions]
  period = math.lcm(*(f.denominator for f in fractions))
  # The small period only where it is the weights (0.7/0.3, 1/3): 0.9994/0.0006 would round
  # to 999/1 (the small source 67 % over its weight).
  if period <= _MAX_PERIOD and all(abs(float(f) - w) < 1e-9 and (f > 0 or w == 0)
                                   for f, w in zip(fractions, shares)):
    return np.array([int(f * period) for f in fractions], np.int64)
  exact = shares * _MAX_PERIOD  # largest remainder
  counts = np.floor(exact).astype(np.int64)
  counts[np.argsort(counts - exact)[:_MAX_PERIOD - counts.sum()]] += 1
  return np.where(shares > 0, np.maximum(counts, 1), 0)  # a source under 1e-5 still gets rows


class _Stage:
  """One weighting from row `start` on: the period table and each source's draws before it."""

  def __init__(self, start: int, counts: np.ndarray, base: np.ndarray):
    self.start, self.counts, self.base = start, counts, base
    period = int(counts.sum())
    credit, table = np.zeros(len(counts), np.int64), np.empty(period, np.int32)
    for r in range(period):  # smooth weighted round robin (module docstring)
      credit += counts
      s = int(np.argmax(credit))
      credit[s] -= period
      table[r] = s
    self.table = table
    self.rank = np.empty(period, np.int64)  # earlier rows of the same source in the period
    for s in range(len(counts)):
      where = np.flatnonzero(table == s)
      self.rank[where] = np.arange(where.size)

  def draws_before(self, row: int) -> np.ndarray:
    q, m = divmod(max(row - self.start, 0), self.table.size)
    return self.base + q * self.counts + np.bincount(self.table[:m], minlength=self.counts.size)

  def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q, m = np.divmod(rows - self.start, self.table.size)
    source = self.table[m]
    return source, self.base[source] + q * self.counts[source] + self.rank[m]


class Schedule:
  """Stages in rows: which source global row g comes from and the how-manieth draw it is."""

  def __init__(self, stages: list[tuple[int, np.ndarray]], base: np.ndarray):
    self.stages = []
    for i, (start, weights) in enumerate(stages):
      if i:
        base = self.stages[-1].draws_before(start)
      self.stages.append(_Stage(start, _counts(weights), base))
    self.starts = np.array([s.start for s in self.stages])

  def draws_before(self, row: int) -> np.ndarray:
    """Rows each source gave to rows < row (of the stages from the first start on)."""
    return self.stages[max(int(np.searchsorted(self.starts, row, 'right')) - 1, 0)].draws_before(
        row)

  def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source index, draw number) of each global row."""
    rows = np.asarray(rows, np.int64)
    which = np.maximum(np.searchsorted(self.starts, rows, 'right') - 1, 0)
    source, draw = np.empty(rows.shape, np.int64), np.empty(rows.shape, np.int64)
    for i in np.unique(which):
      at = which == i
      source[at], draw[at] = self.stages[i].locate(rows[at])
    return source, draw

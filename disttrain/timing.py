"""Where a run's time goes: wall-clock seconds per phase (goodput), and what the loop waits for.

The loop wraps each kind of work in `phases('data')`, `phases('step')`, ... The totals become
the summary line's and run.json's time breakdown; the phase the loop is in right now and the
last step it finished are what the hang watchdog reports.
"""

import contextlib
import time

# Phases in the order they are reported; 'other' is the wall time none of them covers.
PHASES = ('setup', 'compile', 'data', 'step', 'records', 'eval', 'checkpoint', 'profile')


class Phases:
  """Seconds per phase; the current phase; the last finished step and when it finished."""

  def __init__(self):
    self.start = time.perf_counter()
    self.seconds = {name: 0.0 for name in PHASES}
    self.current = 'setup'
    self.last_step: int | None = None
    self.last_beat = time.monotonic()

  @contextlib.contextmanager
  def __call__(self, name: str):
    """Counts the block's wall time as `name` (phases do not nest)."""
    previous, start = self.current, time.perf_counter()
    self.current = name
    try:
      yield
    finally:
      self.seconds[name] += time.perf_counter() - start
      self.current = previous
      self.beat()

  def beat(self) -> None:
    """Progress: the watchdog measures silence from the last beat."""
    self.last_beat = time.monotonic()

  def finished(self, step: int) -> None:
    self.last_step = step
    self.beat()

  def active(self) -> float:
    """Seconds of training work so far: data, steps and records (no compile, eval, saves)."""
    return self.seconds['data'] + self.seconds['step'] + self.seconds['records']

  def breakdown(self) -> dict:
    """{phase: {'seconds', 'fraction'}} over the wall time so far, 'other' the rest; 'wall'."""
    wall = max(time.perf_counter() - self.start, 1e-9)
    out = {name: {'seconds': round(s, 3), 'fraction': round(s / wall, 4)}
           for name, s in self.seconds.items()}
    other = wall - sum(self.seconds.values())
    out['other'] = {'seconds': round(other, 3), 'fraction': round(other / wall, 4)}
    out['wall_seconds'] = round(wall, 3)
    return out


def summary(breakdown: dict) -> str:
  """'step 71%, data 9%, ...': the phases that took at least 0.5 % of the wall time."""
  parts = [f'{name} {100 * v["fraction"]:.0f}%' for name, v in breakdown.items()
           if name != 'wall_seconds' and v['fraction'] >= 0.005]
  return ', '.join(parts)

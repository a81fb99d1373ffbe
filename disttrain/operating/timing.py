"""Where a run's time goes: wall-clock seconds per phase (goodput), and what the loop waits for.

The loop wraps each kind of work in `phases('data')`, `phases('step')`, ... The totals become
the summary line's and run.json's time breakdown; the phase the loop is in right now and the
last step it finished are what the hang watchdog reports.
"""

import time

# Phases in the order they are reported; 'other' is the wall time none of them covers.
PHASES = ('setup', 'compile', 'data', 'sample', 'step', 'records', 'eval', 'checkpoint',
          'profile')
_NOT_TRAINING = ('setup', 'compile', 'eval', 'checkpoint', 'profile')


class Phases:
  """Seconds per phase; the current phase; the last finished step and when it finished.

  A phase entered inside another pauses the outer one: e.g. fetching a record's metrics waits
  for the steps queued before it, which is step time, not record-keeping time.
  """

  def __init__(self):
    self.start = time.perf_counter()
    self.seconds = {name: 0.0 for name in PHASES}
    self.current = 'loop'  # outside every phase: the loop's own work
    self.last_step: int | None = None
    self.last_beat = time.monotonic()
    self._outer: list[str] = []  # the phases paused by the current one, innermost last
    self._since = 0.0  # when the current phase (re)started

  def __call__(self, name: str) -> '_Phase':
    """`with phases('data'): ...` counts the block's wall time as `name`."""
    return _Phase(self, name)

  def _enter(self, name: str) -> None:
    now = time.perf_counter()
    if self._outer:  # inside a phase: it pauses
      self.seconds[self.current] += now - self._since
    self._outer.append(self.current)
    self.current, self._since = name, now

  def _exit(self) -> None:
    now = time.perf_counter()
    self.seconds[self.current] += now - self._since
    self.current, self._since = self._outer.pop(), now
    self.beat()

  def beat(self) -> None:
    """Progress: the watchdog measures silence from the last beat."""
    self.last_beat = time.monotonic()

  def finished(self, step: int) -> None:
    self.last_step = step
    self.beat()

  def active(self) -> float:
    """Seconds of training so far: the wall time less set-up, compilation, evals, checkpoints
    and profiling (data, steps, records and the loop's own bookkeeping stay in)."""
    return time.perf_counter() - self.start - sum(self.seconds[name] for name in _NOT_TRAINING)

  def breakdown(self) -> dict:
    """{phase: {'seconds', 'fraction'}} over the wall time so far, 'other' the rest; 'wall'."""
    wall = max(time.perf_counter() - self.start, 1e-9)
    out = {name: {'seconds': round(s, 3), 'fraction': round(s / wall, 4)}
           for name, s in self.seconds.items()}
    other = wall - sum(self.seconds.values())
    out['other'] = {'seconds': round(other, 3), 'fraction': round(other / wall, 4)}
    out['wall_seconds'] = round(wall, 3)
    return out


class _Phase:
  """The context manager of one phase (a class: the loop enters several every step)."""
  __slots__ = ('phases', 'name')

  def __init__(self, phases: Phases, name: str):
    self.phases, self.name = phases, name

  def __enter__(self) -> None:
    self.phases._enter(self.name)  # pylint: disable=protected-access

  def __exit__(self, *exc) -> None:
    self.phases._exit()  # pylint: disable=protected-access


def summary(breakdown: dict) -> str:
  """'step 71%, data 9%, ...': the phases that took at least 0.5 % of the wall time."""
  parts = [f'{name} {100 * v["fraction"]:.0f}%' for name, v in breakdown.items()
           if name != 'wall_seconds' and v['fraction'] >= 0.005]
  return ', '.join(parts)

"""Process-level facts and decisions that every process must take at the same step."""

import signal
import threading

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
  """Tells, at a step, whether the job was asked to stop (SIGTERM) and must save there.

  With several processes, jax.distributed's preemption service receives the signal and
  `reached_preemption_sync_point` makes every process agree on the same step. A single process
  catches SIGTERM itself (main thread only) and stops at the next step.
  """

  def __init__(self):
    self._requested = threading.Event()
    self._previous = None
    self._multi = jax.process_count() > 1
    if not self._multi and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, lambda *_: self._requested.set())

  def reached(self, step: int) -> bool:
    if self._multi:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._requested.is_set()

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

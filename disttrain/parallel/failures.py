"""One process's failure ends the whole job within seconds, under any launcher.

Without this, a process that fails (bad input on one host, an exception) leaves the others
blocked in a collective with it until the hang watchdog, jax's heartbeat or the scheduler's
timeout ends them, with no word of the cause. The failing process posts its error line and exit
status to jax.distributed's key-value store; every other process watches for it, says it and
exits with the same status (so a supervisor restarts, or not, as it would for the failure itself).
Everyone acknowledges before exiting and waits (at most ACK_SECONDS) for every acknowledgement:
process 0 hosts the store, and its exit takes the store from the rest. A process taken out this
way first runs what the loop registered with `on_leave` (its records, the attempt's end event,
the workdir's lease): its exit skips `finally` blocks.
"""

import contextlib
import json
import os
import sys
import threading
import time
import traceback as traceback_lib
from typing import Any, Callable

KEY = 'disttrain/failed'
ACKS = 'disttrain/failed_ack/'
POLL_SECONDS = 1.0  # a store read a second per process; the main thread may be inside a collective
ACK_SECONDS = 10.0


_leaving = threading.Lock()  # one way out: the main thread's failure or the watch's
_on_leave: list[Callable[[int], None]] = []  # innermost last; see on_leave


def _state() -> Any:
  if 'jax' not in sys.modules:  # nothing started jax.distributed (and this module imports no jax)
    return None
  from disttrain.parallel import distributed  # pylint: disable=g-import-not-at-top
  return distributed.job()


@contextlib.contextmanager
def on_leave(fn: Callable[[int], None]):
  """Within the block, `fn(process)` runs before another process's failure takes this one out:
  that exit skips `finally` blocks, so what must be closed (the event log's end, the lease, a
  bucket's uploads) is closed here. Innermost first; an error in one is printed, not raised."""
  _on_leave.append(fn)
  try:
    yield
  finally:
    _on_leave.remove(fn)


class Watch:
  """A daemon thread that ends this process when another has posted its failure."""

  def __init__(self, poll_seconds: float = POLL_SECONDS):
    self._state = _state()
    self._stop = threading.Event()
    self._thread = None
    if self._state is not None:
      self._thread = threading.Thread(target=self._run, args=(poll_seconds,), daemon=True,
                                      name='disttrain-failures')
      self._thread.start()

  def _run(self, poll_seconds: float) -> None:
    while not self._stop.wait(poll_seconds):
      try:
        posted = self._state.client.key_value_try_get(KEY)
      except Exception:  # pylint: disable=broad-except  (NOT_FOUND: nobody failed)
        continue
      failed = json.loads(posted)
      if _leaving.acquire(blocking=False):  # else this process is already leaving by itself
        print(f'error: process {failed["process"]} failed, so this process stops too (exit '
              f'{failed["status"]}): {failed["line"]}', file=sys.stderr, flush=True)
        for fn in reversed(_on_leave):
          try:
            fn(failed['process'])
          except Exception:  # pylint: disable=broad-except  (the others still need the ack)
            traceback_lib.print_exc()
        _leave(self._state, failed['status'])

  def close(self) -> None:
    """Stops watching (before jax.distributed shuts down at a normal exit); a failing process
    then counts this one as having acknowledged (it will not wait for it)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      try:
        self._state.client.key_value_set(f'{ACKS}{self._state.process_id}', 'done')
      except Exception:  # pylint: disable=broad-except  (already acknowledged, or no store)
        pass


def leaving() -> bool:
  """Another process's failure is taking this one out (the watch says so and exits)."""
  return _leaving.locked()


def hold_if_leaving() -> None:
  """Blocks for good while the watch takes this process out: an error the main thread meets then
  (a collective broken by the failed process's exit) is that failure's echo, not another one."""
  while _leaving.locked():
    time.sleep(60)


def announce(line: str, status: int, traceback: bool = False) -> None:
  """Posts this process's failure and exits with `status` once the others have seen it; returns
  at once in a single-process run (the caller exits as usual). `traceback`: print the exception
  being handled first (the caller's raise would have)."""
  state = _state()
  if state is None:
    return
  if not _leaving.acquire(blocking=False):
    hold_if_leaving()
  if traceback:
    traceback_lib.print_exc()
  line = line.splitlines()[0] if line else '(no message)'
  post = json.dumps({'process': state.process_id, 'status': int(status), 'line': line})
  try:
    state.client.key_value_set(KEY, post)
  except Exception:  # pylint: disable=broad-except  (ALREADY_EXISTS: another failed first)
    try:  # its failure is the job's (this one may only be the collective it broke): its status
      status = json.loads(state.client.key_value_try_get(KEY))['status']
    except Exception:  # pylint: disable=broad-except
      pass
  _leave(state, status)


def _leave(state, status: int) -> None:
  """Acknowledges, waits until every process has, and exits without jax.distributed's shutdown
  (its barrier would wait for processes that are leaving too)."""
  try:
    state.client.key_value_set(f'{ACKS}{state.process_id}', '1')
  except Exception:  # pylint: disable=broad-except  (acknowledged already)
    pass
  try:
    deadline = time.monotonic() + ACK_SECONDS
    while (len(state.client.key_value_dir_get(ACKS)) < state.num_processes
           and time.monotonic() < deadline):
      time.sleep(0.1)
    if state.process_id == 0:
      time.sleep(0.5)  # the store goes with process 0: the others' last reads first
  except Exception:  # pylint: disable=broad-except  (the store went with process 0: leave now)
    pass
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(int(status))  # pylint: disable=protected-access

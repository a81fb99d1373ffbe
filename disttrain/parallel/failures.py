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
The launcher watches for its whole run; disttrain.train, called by a program of the user's in a
multi-process job, watches for its own duration (a round: every process calls it in the same
order) and posts its failure before raising it, the program going on (`post`).
"""

import contextlib
import json
import os
import sys
import threading
import time
import traceback as traceback_lib
from typing import Any, Callable

POLL_SECONDS = 1.0  # a store read a second per process; the main thread may be inside a collective
ACK_SECONDS = 10.0


_leaving = threading.Lock()  # one way out: the main thread's failure or the watch's
_on_leave: list[Callable[[int], None]] = []  # innermost last; see on_leave
_round = 0  # watches started here: a second train() must not count the first one's acks
_watches = 0  # running now


def _keys() -> tuple[str, str]:
  """This round's failure key and acknowledgement directory (a failure before the first watch
  is the first round's)."""
  return f'disttrain/{max(_round, 1)}/failed', f'disttrain/{max(_round, 1)}/failed_ack/'


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
    global _round, _watches  # pylint: disable=global-statement
    self._state = _state()
    self._stop = threading.Event()
    self._thread = None
    _round, _watches = _round + 1, _watches + 1
    self._key, self._acks = _keys()
    if self._state is not None:
      self._thread = threading.Thread(target=self._run, args=(poll_seconds,), daemon=True,
                                      name='disttrain-failures')
      self._thread.start()

  def _run(self, poll_seconds: float) -> None:
    while not self._stop.wait(poll_seconds):
      try:
        posted = self._state.client.key_value_try_get(self._key)
      except Exception:  # pylint: disable=broad-except  (NOT_FOUND: nobody failed)
        continue
      failed = json.loads(posted)
      if failed['process'] == self._state.process_id:  # its own (post's caller raises on)
        continue
      if _leaving.acquire(blocking=False):  # else this process is already leaving by itself
        print(f'error: process {failed["process"]} failed, so this process stops too (exit '
              f'{failed["status"]}): {failed["line"]}', file=sys.stderr, flush=True)
        for fn in reversed(_on_leave):
          try:
            fn(failed['process'])
          except Exception:  # pylint: disable=broad-except  (the others still need the ack)
            traceback_lib.print_exc()
        _acknowledged(self._state, self._acks)
        if failed.get('goes_on'):  # its exit runs jax.distributed's shutdown barrier: meet it
          _shut_down()
        _exit(failed['status'])

  def close(self) -> None:
    """Stops watching (before jax.distributed shuts down at a normal exit); a failing process
    then counts this one as having acknowledged (it will not wait for it)."""
    global _watches  # pylint: disable=global-statement
    if self._stop.is_set():
      return
    self._stop.set()
    _watches -= 1
    if self._thread is not None:
      self._thread.join()
      try:
        self._state.client.key_value_set(f'{self._acks}{self._state.process_id}', 'done')
      except Exception:  # pylint: disable=broad-except  (already acknowledged, or no store)
        pass


def watching() -> bool:
  """A watch runs in this process (the launcher's, or an enclosing train()'s)."""
  return _watches > 0


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
  key, acks = _keys()
  status = _post(state, key, line, status, goes_on=False)
  _acknowledged(state, acks)
  _exit(status)


def post(line: str, status: int) -> None:
  """Posts this process's failure and returns once the others have seen it (they stop with
  `status`); the caller raises on, in a program of the user's. A no-op in a single-process run,
  or when this process is the one being taken out (the error is that failure's echo)."""
  state = _state()
  if state is None or not _leaving.acquire(blocking=False):
    return
  key, acks = _keys()
  try:
    _post(state, key, line, status, goes_on=True)
    _acknowledged(state, acks)
  finally:
    _leaving.release()


def _post(state, key: str, line: str, status: int, goes_on: bool) -> int:
  """Writes the failure to the store; returns the job's status: this one's, or that of another
  process that posted first (this error may be only the collective that one broke). `goes_on`:
  this process raises on instead of leaving, and its exit will wait in jax.distributed's shutdown
  barrier for every process (jax's atexit): the others then meet it there before they leave."""
  line = line.splitlines()[0] if line else '(no message)'
  try:
    state.client.key_value_set(key, json.dumps({'process': state.process_id, 'goes_on': goes_on,
                                                'status': int(status), 'line': line}))
  except Exception:  # pylint: disable=broad-except  (ALREADY_EXISTS: another failed first)
    try:
      status = json.loads(state.client.key_value_try_get(key))['status']
    except Exception:  # pylint: disable=broad-except
      pass
  return status


def _shut_down() -> None:
  """jax.distributed's shutdown, whose barrier ends when the failed process exits (at most its
  shutdown timeout): without it, that process's exit waits for this one until jax's heartbeat
  timeout calls it dead and aborts it."""
  try:
    import jax  # pylint: disable=g-import-not-at-top  (loaded: a store exists)
    jax.distributed.shutdown()
  except Exception:  # pylint: disable=broad-except  (the failed process left first: nothing to meet)
    pass


def _exit(status: int) -> None:
  """Ends this process now: a normal exit would wait in jax.distributed's shutdown barrier for
  processes that are leaving too (or already gone)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(int(status))  # pylint: disable=protected-access


def _acknowledged(state, acks: str) -> None:
  """Acknowledges and waits (at most ACK_SECONDS) until every process has: process 0 hosts the
  store, and its exit takes the store from the rest."""
  try:
    state.client.key_value_set(f'{acks}{state.process_id}', '1')
  except Exception:  # pylint: disable=broad-except  (acknowledged already)
    pass
  try:
    deadline = time.monotonic() + ACK_SECONDS
    while (len(state.client.key_value_dir_get(acks)) < state.num_processes
           and time.monotonic() < deadline):
      time.sleep(0.1)
    if state.process_id == 0:
      time.sleep(0.5)  # the store goes with process 0: the others' last reads first
  except Exception:  # pylint: disable=broad-except  (the store went with process 0: leave now)
    pass

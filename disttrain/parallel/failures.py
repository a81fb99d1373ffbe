"""One process's failure ends the whole job within seconds, under any launcher.

Without this, a process that fails (bad input on one host, an exception) leaves the others
blocked in a collective with it until the hang watchdog, jax's heartbeat or the scheduler's
timeout ends them, with no word of the cause. The failing process posts its error line and exit
status to jax.distributed's key-value store; every other process watches for it, says it and
exits with the same status (so a supervisor restarts, or not, as it would for the failure itself).
Everyone acknowledges before exiting and waits (at most ACK_SECONDS) for every acknowledgement:
process 0 hosts the store, and its exit takes the store from the rest.
"""

import json
import os
import sys
import threading
import time
import traceback as traceback_lib
from typing import Any

KEY = 'disttrain/failed'
ACKS = 'disttrain/failed_ack/'
POLL_SECONDS = 1.0  # a store read a second per process; the main thread may be inside a collective
ACK_SECONDS = 10.0


def _client() -> Any:
  """jax.distributed's client in a multi-process job, else None."""
  if 'jax' not in sys.modules:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  return client if client is not None and jax.process_count() > 1 else None


class Watch:
  """A daemon thread that ends this process when another has posted its failure."""

  def __init__(self, poll_seconds: float = POLL_SECONDS):
    self._client = _client()
    self._stop = threading.Event()
    self._thread = None
    if self._client is not None:
      self._thread = threading.Thread(target=self._run, args=(poll_seconds,), daemon=True,
                                      name='disttrain-failures')
      self._thread.start()

  def _run(self, poll_seconds: float) -> None:
    while not self._stop.wait(poll_seconds):
      try:
        posted = self._client.key_value_try_get(KEY)
      except Exception:  # pylint: disable=broad-except  (NOT_FOUND: nobody failed)
        continue
      failed = json.loads(posted)
      print(f'error: process {failed["process"]} failed, so this process stops too (exit '
            f'{failed["status"]}): {failed["line"]}', file=sys.stderr, flush=True)
      _leave(self._client, failed['status'])

  def close(self) -> None:
    """Stops watching (before jax.distributed shuts down at a normal exit)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()


def announce(line: str, status: int, traceback: bool = False) -> None:
  """Posts this process's failure and exits with `status` once the others have seen it; returns
  at once in a single-process run (the caller exits as usual). `traceback`: print the exception
  being handled first (the caller's raise would have)."""
  client = _client()
  if client is None:
    return
  import jax  # pylint: disable=g-import-not-at-top
  if traceback:
    traceback_lib.print_exc()
  line = line.splitlines()[0] if line else '(no message)'
  post = json.dumps({'process': jax.process_index(), 'status': int(status), 'line': line})
  try:
    client.key_value_set(KEY, post)
  except Exception:  # pylint: disable=broad-except  (ALREADY_EXISTS: another failed first)
    pass
  _leave(client, status)


def _leave(client, status: int) -> None:
  """Acknowledges, waits until every process has, and exits without jax.distributed's shutdown
  (its barrier would wait for processes that are leaving too)."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    client.key_value_set(f'{ACKS}{jax.process_index()}', '1')
    deadline = time.monotonic() + ACK_SECONDS
    while (len(client.key_value_dir_get(ACKS)) < jax.process_count()
           and time.monotonic() < deadline):
      time.sleep(0.1)
  except Exception:  # pylint: disable=broad-except  (the store went with process 0: leave now)
    pass
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(int(status))  # pylint: disable=protected-access

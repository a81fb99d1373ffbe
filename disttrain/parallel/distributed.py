"""Process-level facts and decisions that every process must take at the same step."""

import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from disttrain.errors import DisttrainError, first_line


class DistributedError(DisttrainError):
  """The processes of a multi-process job could not form one job."""


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, *, init_timeout: int = 300,
               heartbeat_timeout: int = 100) -> None:
  """Starts jax.distributed: explicit coordinator, or auto-detected (TPU pods, SLURM, ...).

  On CPU the gloo collectives are selected so that processes really exchange data.
  """
  if jax.config.jax_platforms in (None, '', 'cpu') or 'cpu' in str(jax.config.jax_platforms):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if coordinator_address and num_processes and num_processes > 1 and process_id is not None:
    # jax.distributed aborts the process on a join timeout without saying who is missing.
    _roll_call(coordinator_address, num_processes, process_id, init_timeout)
  try:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=init_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout)
  except Exception as e:  # pylint: disable=broad-except
    message = str(e)
    if coordinator_address is None and 'coordinator_address' in message:
      # Auto-detection found no cluster environment (Cloud TPU pod, SLURM, ...); not a timeout.
      raise DistributedError(
          f'--distributed: JAX detected no cluster to join ({message}); on a multi-host TPU '
          'slice run the same command on every host, elsewhere pass --coordinator_address='
          'HOST:PORT --num_processes=N --process_id=I') from e
    if isinstance(e, ValueError):  # its arguments (a count or id neither given nor detected)
      raise DistributedError(
          f'jax.distributed cannot start: {first_line(e, 200).rstrip(".")}; pass --num_processes=N and '
          '--process_id=I (or JAX_NUM_PROCESSES, JAX_PROCESS_ID) with --coordinator_address') from e
    missing = sorted({int(t) for t in re.findall(r'task:(\d+)', message)} - {process_id})
    who = (f'process(es) {missing} did not join' if missing else
           f'not all {num_processes} processes joined')
    raise DistributedError(
        f'jax.distributed did not start within {init_timeout}s: {who} (coordinator '
        f'{coordinator_address}, this is process {process_id}); start every process with the '
        f'same --coordinator_address and --num_processes, or raise --distributed_init_timeout'
    ) from e
  _no_compilation_cache_across_cpu_processes()


def _no_compilation_cache_across_cpu_processes() -> None:
  """Turns jax's persistent compilation cache off in a multi-process job on CPU.

  With jax 0.12.1 a 2-process CPU job deadlocks in its first cross-process collective once the
  cache holds its programs: process 0 runs the executable it wrote, the others (whose cache keys
  differ) compile theirs, and the two never meet in gloo (measured, 2026-12-07). GPU and TPU jobs,
  where compiles are long, keep the cache (not measured here).
  """
  if (jax.process_count() > 1 and jax.default_backend() == 'cpu'
      and jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
    jax.config.update('jax_enable_compilation_cache', False)
    if jax.process_index() == 0:
      print(f'disttrain: the persistent compilation cache '
            f'({jax.config.jax_compilation_cache_dir}) is off in this multi-process CPU job: '
            'its cached executables deadlock in cross-process collectives', flush=True)


_ID_SECONDS = 10.0  # for a connection to the roll call to name its process


def _process_id(line: str, num_processes: int) -> int:
  process = int(line)
  if not 0 < process < num_processes:
    raise ValueError(f'process id {process} is not in 1..{num_processes - 1}')
  return process


def _roll_call(address: str, num_processes: int, process_id: int, timeout: float) -> None:
  """Every process checks in with process 0 on the coordinator's port + 1 before JAX starts.

  Process 0 names the process ids that did not arrive in time; the others say the coordinator
  did not release them. Everyone proceeds only when all have checked in.
  """
  host, port = address.rsplit(':', 1)
  host, port = host.strip('[]'), int(port) + 1  # [::1]:PORT, as jax.distributed takes it
  deadline = time.monotonic() + timeout
  if process_id == 0:
    try:  # IPv4 and IPv6 (jax.distributed listens on both)
      dual = socket.has_dualstack_ipv6()
      server = socket.create_server(('', port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                    dualstack_ipv6=dual)
    except (OSError, OverflowError) as e:  # OverflowError: port 65536
      raise DistributedError(f'cannot listen on port {port} (coordinator port + 1) for the roll '
                             f'call: {getattr(e, "strerror", None) or e}; pick another '
                             '--coordinator_address port') from e
    joined: dict[int, socket.socket] = {}
    with server:
      while len(joined) < num_processes - 1 and time.monotonic() < deadline:
        server.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
          conn, _ = server.accept()
        except socket.timeout:
          continue
        # A process sends its id at once; a connection that sends nothing (a port probe) held
        # the roll call until its deadline.
        conn.settimeout(min(_ID_SECONDS, max(deadline - time.monotonic(), 0.01)))
        try:
          joined[_process_id(conn.makefile().readline(), num_processes)] = conn
        except (OSError, ValueError):
          conn.close()
      missing = sorted(set(range(1, num_processes)) - set(joined))
      for conn in joined.values():
        if not missing:
          conn.sendall(b'go\n')
        conn.close()
    if missing:
      raise DistributedError(
          f'process(es) {missing} of {num_processes} did not join within {timeout:.0f}s '
          f'(coordinator {address}); start them with --coordinator_address={address} '
          f'--num_processes={num_processes}, or raise --distributed_init_timeout')
    return
  last = ''
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.01)) \
          as conn:
        conn.sendall(f'{process_id}\n'.encode())
        if conn.makefile().readline().strip() == 'go':
          return
        last = 'it closed the roll call without starting the job'  # its deadline, or not ours
      time.sleep(0.5)
    except socket.timeout:
      break  # the deadline
    except OSError as e:  # not listening yet, or its name not resolvable yet (a pod starting)
      last = f'last try: {e.strerror or e}'
      time.sleep(0.5)
  raise DistributedError(
      f'process {process_id}: the coordinator (process 0 at {address}) did not start the job '
      f'within {timeout:.0f}s{f" ({last})" if last else ""}; start process 0 and every other '
      'process with the same --coordinator_address and --num_processes, or raise '
      '--distributed_init_timeout')


def job() -> Any:
  """jax.distributed's state (its key-value store `client`, `process_id`, `num_processes`) in a
  multi-process job, else None. The one reader of jax's private state (the store has no public
  handle); it asks jax for no devices (a client that failed to connect must not start a backend)."""
  try:
    from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
    state = jax_distributed.global_state
    return state if state.client is not None and (state.num_processes or 1) > 1 else None
  except Exception:  # pylint: disable=broad-except  (a jax without this private state)
    return None


def free_port_pair() -> int:
  """A free loopback port p with p + 1 also free (the roll call listens on p + 1)."""
  for _ in range(100):
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      port = s.getsockname()[1]
    try:
      with socket.socket() as a, socket.socket() as b:
        a.bind(('127.0.0.1', port))
        b.bind(('127.0.0.1', port + 1))
      return port
    except OSError:
      continue
  raise RuntimeError('no free pair of loopback ports')


def ignored(signum: int) -> bool:
  """The signal was ignored when this process started (a background job's SIGINT): leave it so."""
  return signal.getsignal(signum) is signal.SIG_IGN


class StopSignals:
  """SIGTERM (preemption) and SIGINT (Ctrl-C) as a stop at one step that every process agrees on.

  With several processes, jax.distributed's preemption service catches SIGTERM (measured: also
  in CPU processes) and `reached_preemption_sync_point` makes every process agree on one call:
  the fastest process's last call + 1, matched by equality. So the id passed must advance by
  exactly one per call; step numbers advance by steps_per_dispatch and would never match, so
  this counts its own calls. A Ctrl-C is turned into that same SIGTERM path (the process sends
  itself SIGTERM), remembered as an interrupt. A single process catches both signals itself
  (main thread only) and stops at the next step. After the first Ctrl-C, a second one gets the
  default action: the process ends at once, without a traceback. A process started with SIGINT
  ignored (a background job: `cmd &` in a script, nohup, a CI runner) leaves it ignored, as
  shells do: the terminal's Ctrl-C is not meant for it; SIGTERM still stops it with a checkpoint.
  """

  def __init__(self):
    self._terminated = threading.Event()
    self._interrupted = threading.Event()
    self._previous = {}
    self._calls = 0
    self._multi = jax.process_count() > 1
    if threading.current_thread() is threading.main_thread():
      if not self._multi:
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM,
                                                       lambda *_: self._terminated.set())
      if not ignored(signal.SIGINT):
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)

  def _on_interrupt(self, *_) -> None:
    self._interrupted.set()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the second Ctrl-C ends the process at once
    when = 'a step every process agrees on' if self._multi else 'the next step'
    print(f'interrupted: saving a checkpoint at {when}, then stopping (Ctrl-C again to exit at '
          'once, without one)', file=sys.stderr, flush=True)
    if self._multi:
      os.kill(os.getpid(), signal.SIGTERM)  # jax's preemption service tells every process

  @property
  def interrupted(self) -> bool:
    """A Ctrl-C reached this process."""
    return self._interrupted.is_set()

  def reached(self, step: int) -> bool:
    """True at the (dispatched) step where every process must save and stop.

    Call it once per dispatch, the same number of times on every process.
    """
    del step  # the sync protocol needs a counter that advances by one per call
    self._calls += 1
    if self._multi:
      return multihost_utils.reached_preemption_sync_point(self._calls)
    return self._terminated.is_set() or self._interrupted.is_set()

  def close(self) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any (a collective: call it on all of them)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))

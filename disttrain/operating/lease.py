"""One run per workdir: DIR/lease.json names the process that trains there and is refreshed.

Schedulers and supervisors do start a new attempt while a stale one still runs; two runs in one
workdir clean up each other's in-progress checkpoints and interleave their records. So process
0 holds a lease before it touches the workdir: host, pid, attempt, start time and `refreshed`,
rewritten every `seconds / 4` by a thread. A second launch finds it and decides:
- held by a process of this host: taken over if that process no longer exists (SIGKILL, the
  OOM killer; pid and start time, so a reused pid is not mistaken for it), else refused with one
  line naming it (exit 2);
- held on another host (or by a restarted pod's predecessor): it watches the lease for `seconds`
  of its own clock; a refresh means the holder lives (refused, within about `seconds / 4`), none
  means a dead run, and the lease is taken over.
"This host" is the host name and the pid namespace and boot (a container sharing the host's
name has its own pids). A holder that finds the lease naming another run at a refresh (it was
paused past `seconds` and was taken over) stops at once with one line, exit 2, writing nothing.
A run releases its lease when it ends, however it ends (short of SIGKILL).
"""

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time

from disttrain.errors import ConfigError
from disttrain.exitcodes import Exit
from disttrain.storage import urls

FILE = 'lease.json'
# A bucket, NFS or FUSE has no lock across hosts: launches that wrote at once read back after
# this; the last write holds.
_SETTLE_SECONDS = 1.0
_LOCK_MARGIN_SECONDS = 10.0  # beyond twice lease_seconds, a launch holding the lock is stuck


def _started(pid: int) -> int | None:
  """When process `pid` started (clock ticks since boot), None if there is no such process: a
  pid reused by another process, e.g. in a restarted container, has another start time."""
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      return int(f.read().rsplit(')', 1)[1].split()[19])
  except (OSError, ValueError, IndexError):
    return None


def _namespace() -> str:
  """This process's pid namespace and boot: pids compare only where both are the same."""
  try:
    pids = os.readlink('/proc/self/ns/pid')
    with open('/proc/sys/kernel/random/boot_id', encoding='utf-8') as f:
      return f'{pids} {f.read().strip()}'
  except OSError:
    return ''


def _alive(holder: dict) -> bool:
  """The holder's process still runs (on this host)."""
  pid = int(holder.get('pid', -1))
  if holder.get('pid_start') is not None and os.path.isdir('/proc'):
    return _started(pid) == holder['pid_start']
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


def _shared_mount(path: str, table: str = '/proc/mounts') -> bool:
  """`path` is on a network or FUSE file system (NFS, gcsfuse, ...), per the mount table."""
  try:
    with open(table, encoding='utf-8') as f:
      mounts = [line.split() for line in f]
  except OSError:
    return False
  real, best, kind = os.path.realpath(path), '', ''
  for fields in mounts:
    point = fields[1] if len(fields) > 2 else ''
    if point and (real == point or real.startswith(point.rstrip('/') + '/')) and \
        len(point) >= len(best):
      best, kind = point, fields[2]
  return kind.startswith(('nfs', 'fuse', 'cifs', 'smb', 'ceph', 'lustre', 'gpfs', '9p'))


class Lease:
  """Held from `acquire()` to `release()`; `seconds` <= 0 disables it."""

  def __init__(self, workdir: str, seconds: float, attempt: int = 0):
    self.workdir, self.path = workdir, urls.join(workdir, FILE)
    self.seconds = seconds
    self.me = {'host': socket.gethostname(), 'pid': os.getpid(), 'attempt': attempt,
               'started': round(time.time(), 3), 'pid_start': _started(os.getpid()),
               'namespace': _namespace()}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _read(self) -> dict | None:
    """The lease; None if there is none; {} if it cannot be read now (a torn write, a glitch)."""
    try:
      text = urls.read_text(self.path)
      return None if text is None else json.loads(text)
    except (OSError, json.JSONDecodeError):
      return {}

  def _write(self) -> None:
    # Readers see the old lease or the new one, never half of one.
    urls.write_text(self.path, json.dumps(
        {**self.me, 'refreshed': round(time.time(), 3), 'seconds': self.seconds}))

  def _refuse(self, holder: dict) -> None:
    age = time.time() - holder.get('refreshed', 0)
    raise ConfigError(
        f'{self.workdir} is in use by another run (host {holder.get("host")}, pid '
        f'{holder.get("pid")}, attempt {holder.get("attempt")}, started '
        f'{time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))}, lease '
        f'refreshed {age:.0f}s ago); wait for it to end or stop it, or pass another --workdir')

  def _outlive(self, holder: dict) -> None:
    """Returns once the holder is known dead; raises ConfigError while it lives."""
    if holder.get('host') == self.me['host'] and \
        holder.get('namespace', self.me['namespace']) == self.me['namespace']:
      if holder.get('pid') == self.me['pid'] and \
          holder.get('pid_start') == self.me['pid_start']:
        return  # this process's own lease (an earlier train() call)
      if _alive(holder):
        self._refuse(holder)
      return
    # Another host's holder (or a restarted pod's predecessor): alive only if it refreshes. Timed
    # by this host's clock alone: the holder's clock wrote `refreshed`, and clocks differ (a
    # clock ahead by `seconds` took a live run's lease at once, which then stopped).
    seconds = holder.get('seconds', self.seconds)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
      time.sleep(min(1.0, seconds / 8))
      now = self._read()
      if now is None:
        return  # released
      if now and now.get('refreshed') != holder.get('refreshed'):
        self._refuse(now)

  def acquire(self) -> None:
    if self.seconds <= 0:
      return
    try:
      with self._exclusive():  # two launches at once both read "no lease" and both wrote one
        holder = self._read()
        if holder:  # an unreadable one was torn by a crash: nobody refreshes it
          self._outlive(holder)
        self._write()
    except OSError as e:
      raise ConfigError(f'workdir={self.workdir!r} cannot be used ({e.strerror}); '
                        'pass a writable directory path') from e
    if urls.is_bucket(self.workdir) or _shared_mount(self.workdir):
      # No lock across hosts there (NFS and FUSE lock this host only): the last writer holds it.
      time.sleep(_SETTLE_SECONDS)
      holder = self._read()
      if holder and not self._mine(holder):
        self._refuse(holder)
    self._thread = threading.Thread(target=self._refresh, name='disttrain-lease', daemon=True)
    self._thread.start()

  @contextlib.contextmanager
  def _exclusive(self):
    """A local workdir's lock (flock on the directory) around reading and taking the lease."""
    if urls.is_bucket(self.workdir):
      yield
      return
    os.makedirs(self.workdir, exist_ok=True)
    fd = os.open(self.workdir, os.O_RDONLY)
    # Its holder waits out at most a dead lease: longer, it was stopped (Ctrl-Z) or hangs.
    wait = 2 * self.seconds + _LOCK_MARGIN_SECONDS
    deadline = time.monotonic() + wait
    try:
      while True:
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
          break
        except BlockingIOError:
          if time.monotonic() > deadline:
            raise ConfigError(f'another launch into {self.workdir} has held its lease lock for '
                              f'{wait:.0f}s (stopped, or on a hung mount); end it, or pass '
                              'another --workdir') from None
          time.sleep(0.1)
        except OSError:  # a file system without flock: unlocked, as before
          break
      yield
    finally:
      os.close(fd)  # releases the lock

  def _mine(self, holder: dict) -> bool:
    return all(holder.get(k) == self.me[k] for k in ('host', 'pid', 'pid_start', 'started'))

  def _refresh(self) -> None:
    while not self._stop.wait(self.seconds / 4):
      try:
        holder = self._read()
      except Exception:  # pylint: disable=broad-except  (a bucket client's glitch: refresh on)
        holder = {}
      if holder and not self._mine(holder):  # taken over while this process was paused
        print(f'error: ConfigError: {self.workdir} was taken over by another run (host '
              f'{holder.get("host")}, pid {holder.get("pid")}, attempt {holder.get("attempt")}) '
              f'while this one did not refresh its lease for {self.seconds:g}s; stopping '
              'without writing there again (it trains on)', file=sys.stderr, flush=True)
        os._exit(Exit.BAD_INPUT)  # pylint: disable=protected-access  (no save, no cleanup)
      try:
        self._write()
      except Exception:  # pylint: disable=broad-except
        # A full disk, a gone mount or an unreachable bucket: the run itself will say so.
        pass

  def release(self) -> None:
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    self._thread = None
    holder = self._read()
    if holder and self._mine(holder):
      urls.path(self.path).unlink(missing_ok=True)

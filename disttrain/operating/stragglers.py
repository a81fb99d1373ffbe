"""Who is slow: each process's stalls and data waits, compared across a job's processes.

A heartbeat thread in every process ticks every TICK seconds and counts the time between ticks
beyond two ticks as stalled: the process did not run (stopped, swapped out, a stop-the-world
pause, a starved CPU). The processes of a synchronous job all slow down when one stalls (they
wait for it in the step's collectives), so step times cannot tell them apart; stalls can, and so
can waits for data: the process whose input is slow waits in `next(batches)` while the others
wait for it inside the step. At each train record every process publishes both (seconds since
the previous record) in jax.distributed's key-value store; process 0 reads the previous record's
entries (one record late: nobody waits for them), and names a straggler when, over the last
WINDOW_SECONDS of records, one process was stalled (or waited for data) for at least MARGIN of
the time and at least twice as long as any other plus MARGIN / 4: one console line and an
events.jsonl `straggler` event (process, host, step, cause 'stalled' or 'data', its fraction as
stalled_fraction or data_fraction, the others' largest, the seconds compared); again only after
it recovered. Single-process runs do nothing.
"""

import collections
import socket
import threading
import time
from typing import Callable

CAUSES = ('stalled', 'data')
TICK = 0.05
MARGIN = 0.2  # a straggler stalled >= 20 % of the window
WINDOW_SECONDS = 5.0
_PREFIX = 'disttrain/stragglers'
_RUNS = collections.Counter()  # process -> monitors made: a program may train twice in a job


class Heartbeat:
  """A daemon thread's count of the seconds this process did not run (gaps beyond 2 ticks)."""

  def __init__(self, tick: float = TICK):
    self.tick, self.stalled = tick, 0.0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name='disttrain-heartbeat', daemon=True)
    self._thread.start()

  def _run(self) -> None:
    last = time.monotonic()
    while not self._stop.wait(self.tick):
      now = time.monotonic()
      self.stalled += max(now - last - 2 * self.tick, 0.0)
      last = now

  def close(self) -> None:
    self._stop.set()
    self._thread.join()


class Monitor:
  """note(step) at every train record, on every process (module doc)."""

  def __init__(self, client, process: int, processes: int, say: Callable[[str], None],
               emit: Callable[..., None]):
    self.client, self.process, self.processes = client, process, processes
    # The store lives as long as the job: each run its own keys (the processes make their
    # monitors in the same order).
    _RUNS[process] += 1
    self.key, self.say, self.emit = f'{_PREFIX}/{_RUNS[process]}', say, emit
    self.host = socket.gethostname()
    self.heartbeat = Heartbeat()
    self._sent = (0.0, 0.0)  # stalled and data seconds already published
    self._previous = None  # the step noted last (process 0 reads it at the next note)
    self.history = collections.deque()  # (time, {process: (stalled, data) seconds})
    self.named: set[tuple[int, str]] = set()  # (process, cause)

  @classmethod
  def start(cls, processes: int, process: int, say, emit) -> 'Monitor | None':
    if processes < 2:
      return None
    from disttrain.parallel import distributed  # pylint: disable=g-import-not-at-top
    job = distributed.job()
    return None if job is None else cls(job.client, process, processes, say, emit)

  def note(self, step: int, data_seconds: float = 0.0) -> None:
    """`data_seconds`: this process's total wait for batches so far."""
    now = (self.heartbeat.stalled, data_seconds)
    stalled, data = (a - b for a, b in zip(now, self._sent))
    self.client.key_value_set(f'{self.key}/{step}/{self.process}',
                              f'{stalled:.4f} {data:.4f} {self.host}')
    self._sent = now
    if self.process == 0 and self._previous is not None:
      self._judge(self._previous)
    self._previous = step

  def _judge(self, step: int) -> None:
    entries = dict(self.client.key_value_dir_get(f'{self.key}/{step}/'))
    if len(entries) < self.processes:
      return  # a process has not published yet: judge the windows that are complete
    for key in entries:
      self.client.key_value_delete(key)
    now = time.monotonic()
    values = {int(k.rsplit('/', 1)[1]): v.split(' ', 2) for k, v in entries.items()}
    self.hosts = {p: host for p, (*_, host) in values.items()}
    self.history.append((now, {p: (float(stalled), float(data))
                               for p, (stalled, data, _) in values.items()}))
    while len(self.history) > 2 and now - self.history[1][0] >= WINDOW_SECONDS:
      self.history.popleft()
    seconds = now - self.history[0][0]
    if seconds < WINDOW_SECONDS / 2:
      return
    for i, cause in enumerate(CAUSES):
      totals = collections.Counter()
      for _, both in list(self.history)[1:]:  # seconds since the first entry's record
        totals.update({p: value[i] for p, value in both.items()})
      self._name(cause, {p: totals[p] / seconds for p in range(self.processes)}, seconds, step)

  def _name(self, cause: str, shares: dict[int, float], seconds: float, step: int) -> None:
    for p, share in shares.items():
      if cause == 'data' and (p, 'stalled') in self.named:
        continue  # a stop that fell inside a wait for data counts as both: name the stall
      others = max(s for q, s in shares.items() if q != p)
      slow = share >= MARGIN and share >= 2 * others + MARGIN / 4
      if slow and (p, cause) not in self.named:
        self.named.add((p, cause))
        what = 'was stalled' if cause == 'stalled' else 'waited for its data'
        self.say(f'straggler: process {p} ({self.hosts[p]}) {what} {share:.0%} of the last '
                 f'{seconds:.1f}s (the others at most {others:.0%}) by step {step}'
                 + ('' if cause == 'stalled' else ': its input is the slowest (its storage, '
                    'data.workers)'))
        self.emit('straggler', process=p, host=self.hosts[p], step=step, cause=cause,
                  **{f'{cause}_fraction': round(share, 4)}, others_max=round(others, 4),
                  seconds=round(seconds, 3))
      elif not slow and share < MARGIN / 2:
        self.named.discard((p, cause))  # recovered: a later one is named again

  def close(self) -> None:
    self.heartbeat.close()



"""DIR/events.jsonl: what happened to a run across all its attempts, one JSON object a line.

Process 0 of each attempt appends `start` (attempt, host, pid, processes), `restore` (the step
it resumed from; `trained_through`: the last step logged past it by the attempts before, whose
records were moved to metrics.superseded.jsonl) and `end` (the step reached, why it stopped or
the error, the time breakdown as run.json's `time`); launch/supervise.py appends `exit`
(an attempt's status, the verdict, the committed step, the restart delay) between attempts.
Every event has `time` (seconds since the epoch) and `event`. The supervisor, goodput reports
and trackers read it; it is a public interface (docs/outputs.md). Nothing here imports jax.
"""

import json
import os
import socket
import time

from disttrain.storage import urls

FILE = 'events.jsonl'


def read(workdir: str) -> list[dict]:
  """Every complete event of the run, oldest first (a line cut short by a kill is skipped)."""
  out = []
  try:
    data = urls.path(urls.join(workdir, FILE)).read_bytes()
  except FileNotFoundError:
    data = b''
  for line in data.decode('utf-8', errors='replace').splitlines():  # bad bytes spoil their line
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict):  # anything else is not an event of ours
      out.append(record)
  return out


def next_attempt(workdir: str) -> int:
  """1 for a new run, k + 1 after k started attempts (by hand, a scheduler or the supervisor)."""
  return 1 + sum(e.get('event') == 'start' for e in read(workdir))


class EventLog:
  """Appends events to DIR/events.jsonl; silent where not `enabled` (processes other than 0)."""

  def __init__(self, workdir: str, enabled: bool):
    self.path = urls.join(workdir, FILE)
    self.enabled = enabled
    self.attempt = next_attempt(workdir) if enabled else 0
    self.started = False
    self.began = time.time()  # an attempt's start-up counts from here, not from its first event

  def emit(self, event: str, at: float | None = None, **fields) -> None:
    if not self.enabled:
      return
    record = {'time': round(time.time() if at is None else at, 3), 'event': event,
              'attempt': self.attempt, **fields}
    urls.append_line(self.path, json.dumps(record))

  def start(self, processes: int) -> None:
    """The attempt's first event, dated when this log was made (train() was called)."""
    supervised = os.environ.get('DISTTRAIN_ATTEMPT')
    self.emit('start', at=self.began, host=socket.gethostname(), pid=os.getpid(),
              processes=processes,
              **({'supervisor_attempt': int(supervised)} if supervised else {}))
    self.started = True

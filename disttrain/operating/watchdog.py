"""A hang watchdog: when no step finishes for `seconds`, every process says where it is stuck.

Each process's watchdog thread writes its process id, host, pid, last finished step, what the
loop was waiting for (data, step, eval, checkpoint, records) and every thread's Python stack
(faulthandler) to stderr and to DIR/hang/process_<i>.txt. Process 0 then reads the others' files
(a shared workdir, as checkpoints need anyway; an earlier attempt's are ignored) and names the
slowest one in one line; every process exits with HANG_EXIT_CODE. A process waiting in 'step'
is blocked in a collective, so it is the others it waits for: the slowest is the one with the
lowest last step, and among equals the one waiting for anything but a step.
"""

import faulthandler
import json
import os
import socket
import sys
import tempfile
import threading
import time

import jax

from disttrain.exitcodes import Exit
from disttrain.operating.timing import Phases
from disttrain.storage import urls

HANG_EXIT_CODE = Exit.HANG
_GRACE = 15.0  # seconds a process waits for the others' reports before it exits
_CLOCK_SKEW = 5.0  # seconds hosts' clocks may differ by (a new attempt starts far later)
_WAITING = {'step': 'the step (a collective: waiting for another process)', 'data': 'data',
            'sample': 'sampling (GRPO: the decoder or the reward functions)',
            'eval': 'eval', 'checkpoint': 'a checkpoint', 'records': 'a record: fetching a step\'s '
            'metrics, or a callback or tracker given it (on_train_record)',
            'profile': 'the profiler', 'compile': 'compilation', 'setup': 'set-up',
            'loop': "the loop's own work between phases (callbacks, agreeing on a stop)"}


def default_seconds(configured: int) -> int:
  """-1: 600 s for multi-process runs (where silent hangs happen), off for one process."""
  if configured == -1:
    return 600 if jax.process_count() > 1 else 0
  return configured


class Watchdog:
  """Fires once if `phases` shows no beat for `seconds`; see the module doc."""

  def __init__(self, seconds: float, phases: Phases, workdir: str):
    self.seconds, self.phases = seconds, phases
    self.folder = urls.join(workdir, 'hang')
    self.since = time.time()  # reports fired before it are an earlier attempt's
    self._stop = threading.Event()
    self._thread = None
    if seconds > 0:
      self._thread = threading.Thread(target=self._watch, name='disttrain-watchdog', daemon=True)
      self._thread.start()

  def close(self) -> None:
    self._stop.set()

  def _watch(self) -> None:
    while not self._stop.wait(min(1.0, self.seconds / 10)):
      silent = time.monotonic() - self.phases.last_beat
      if silent > self.seconds:
        self._fire(silent)

  def _status(self, silent: float) -> dict:
    return {'process': jax.process_index(), 'pid': os.getpid(), 'host': socket.gethostname(),
            'last_step': self.phases.last_step, 'waiting_for': self.phases.current,
            'silent_seconds': round(silent, 1), 'fired_at': time.time()}

  def _fire(self, silent: float) -> None:
    status = self._status(silent)
    line = (f'watchdog: process {status["process"]} (pid {status["pid"]} on {status["host"]}) '
            f'finished no step for {silent:.0f}s (watchdog_seconds={self.seconds:g}); last '
            f'finished step {status["last_step"]}, waiting for '
            f'{_WAITING.get(status["waiting_for"], status["waiting_for"])}')
    print(line, file=sys.stderr, flush=True)
    try:  # the process must still exit below if the workdir cannot take the report
      with tempfile.TemporaryFile('w+', encoding='utf-8') as f:  # faulthandler needs a real file
        f.write(json.dumps(status) + '\n' + line + '\n\n')
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        # Complete files only (process 0 reads them), in the workdir, local or a bucket.
        urls.write_text(urls.join(self.folder, f'process_{status["process"]}.txt'), f.read())
    except Exception as e:  # pylint: disable=broad-except
      print(f'watchdog: could not write its report to {self.folder}: {type(e).__name__}: {e}',
            file=sys.stderr, flush=True)
    try:
      faulthandler.dump_traceback(sys.stderr, all_threads=True)
      reports = self._reports(jax.process_count())
      if status['process'] == 0:
        print(self._verdict(reports, jax.process_count()), file=sys.stderr,
              flush=True)
    finally:
      os._exit(HANG_EXIT_CODE)  # the main thread is stuck: nothing else can end the process

  def _reports(self, count: int) -> list[dict]:
    """The statuses in DIR/hang/, waiting up to _GRACE seconds for all `count` processes."""
    deadline = time.monotonic() + _GRACE
    while True:
      reports = []
      for i in range(count):
        try:
          text = urls.read_text(urls.join(self.folder, f'process_{i}.txt'))
          report = json.loads(text.split('\n', 1)[0])
        except (OSError, ValueError, AttributeError):  # not written yet (AttributeError: None)
          continue
        if report.get('fired_at', 0) > self.since - _CLOCK_SKEW:
          reports.append(report)
      if len(reports) == count or time.monotonic() > deadline:
        return reports
      time.sleep(0.2)

  def _verdict(self, reports: list[dict], count: int) -> str:
    """One line naming the slowest process (of `count`): one that wrote no report while those
    that did wait in the step's collective, else the one furthest behind."""
    if not reports:
      return (f'watchdog: no process report could be read from {self.folder}/; each process '
              'printed its stacks to its stderr')
    silent = sorted(set(range(count)) - {r['process'] for r in reports})
    if silent and all(r['waiting_for'] == 'step' for r in reports):
      return (f'watchdog: process(es) {silent} wrote no report (died, or hung holding Python\'s '
              'lock in a C call) while the others wait for them in the step\'s collective: '
              f'look there first; stacks of the others in {self.folder}/')
    incomplete = bool(silent)
    step = lambda r: -1 if r['last_step'] is None else r['last_step']
    slowest = min(reports, key=lambda r: (step(r), r['waiting_for'] == 'step', r['process']))
    missing = ' (some processes wrote no report: they may have died)' if incomplete else ''
    return (f'watchdog: process {slowest["process"]} on {slowest["host"]} is the slowest: last '
            f'finished step {slowest["last_step"]}, waiting for '
            f'{_WAITING.get(slowest["waiting_for"], slowest["waiting_for"])}; stacks of every '
            f'process in {self.folder}/{missing}')

r"""Restart a training job from its last committed checkpoint until it finishes or gives up.

  disttrain supervise [--max_restarts=3 --max_preemptions=100 --backoff_seconds=10] -- \
      disttrain cluster --num_processes=2 -- --config=... --workdir=DIR
  (python launch/supervise.py ... is the same program)

The command after `--` is the launcher command of one job: `disttrain train` (one process),
`disttrain cluster` (a gang on this host), or a host's own process under a scheduler. Each
attempt runs in a process group of its own, with DISTTRAIN_ATTEMPT=1, 2, ... in its environment;
what is left of that group is killed before the next attempt starts, so two gangs never share
the workdir. The exit status decides (disttrain/exitcodes.py): 0 done; 2 (bad input) and 130
(Ctrl-C) end the supervisor with that status; 75 (preempted, saved) restarts at once without
spending the failure budget (--max_preemptions bounds those); 3 (hang), a death by a signal and
any other status restart after an exponential backoff with jitter and count as failures. The
count goes back to 0 whenever an attempt advanced the committed checkpoint (either tier:
DIR/local_tier.json names the fast tier's newest step); --max_restarts
failures in a row without progress end it with one line and the last status. SIGTERM and SIGINT
are passed to the job, which saves and stops; the supervisor then stops too (during a backoff,
with nothing to save, at once: exit 128 + the signal). A supervisor started with SIGINT ignored,
in the background, leaves it ignored, and so does its job. Each attempt's end
is appended to DIR/events.jsonl (`exit` events).
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

from absl import flags

from disttrain import commandline
from disttrain.exitcodes import Exit, Verdict, describe, shell_status, verdict
from disttrain.operating import events
from disttrain.storage import progress, urls

_MAX_RESTARTS = flags.DEFINE_integer(
    'max_restarts', 3, 'Failed attempts in a row, without a newer committed checkpoint, that are '
    'restarted before the supervisor gives up.')
_MAX_PREEMPTIONS = flags.DEFINE_integer(
    'max_preemptions', 100, 'Preemptions (exit 75) restarted in all; they do not count as failures.')
_BACKOFF = flags.DEFINE_float(
    'backoff_seconds', 10, 'Delay before the first restart after a failure; doubles with each '
    'failure in a row (x0.5-1.5 jitter), at most --max_backoff_seconds.')
_MAX_BACKOFF = flags.DEFINE_float('max_backoff_seconds', 300, 'Longest delay between attempts.')


def workdir_of(command: list[str]) -> str | None:
  """The --workdir the launcher command passes (the last one, as absl reads it)."""
  found = None
  for i, arg in enumerate(command):
    if arg.startswith('--workdir='):
      found = arg.split('=', 1)[1]
    elif arg == '--workdir' and i + 1 < len(command):
      found = command[i + 1]
  return found


class Supervisor:
  """Runs attempts of `command` until one finishes, one is final, or the budgets run out."""

  def __init__(self, command: list[str], workdir: str, max_restarts: int, max_preemptions: int,
               backoff: float, max_backoff: float, say=print):
    self.command, self.workdir = command, workdir
    self.max_restarts, self.max_preemptions = max_restarts, max_preemptions
    self.backoff, self.max_backoff = backoff, max_backoff
    self.say = say
    self._proc: subprocess.Popen | None = None
    self._stopping = 0  # the signal that stops the supervisor, once one came
    self.log = events.EventLog(workdir, enabled=True)

  def _forward(self, signum, _) -> None:
    self._stopping = signum  # the job saves and stops; it is not restarted after that
    if self._proc is not None and self._proc.poll() is None:
      os.killpg(self._proc.pid, signum)

  def _attempt(self, attempt: int) -> int:
    env = dict(os.environ, DISTTRAIN_ATTEMPT=str(attempt))
    self._proc = subprocess.Popen(self.command, env=env, start_new_session=True)
    code = shell_status(self._proc.wait())
    try:  # whatever the job left behind (a worker, a stuck process) goes before the next gang
      os.killpg(self._proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    return code

  def delay(self, failures: int) -> float:
    """Doubling per failure, x0.5-1.5 jitter, never above max_backoff (the exponent is capped:
    a float overflows past 2**1023)."""
    base = min(self.max_backoff, self.backoff * 2.0 ** min(max(failures - 1, 0), 60))
    return min(self.max_backoff, base * random.uniform(0.5, 1.5))

  def run(self) -> int:
    previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
      return self._run()
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, handler)

  def _end(self, record: dict, code: int, why: str = '') -> int:
    """The last attempt's exit event, one line saying why (unless done), and the status."""
    self.log.emit('exit', **record)
    if why:
      self.say(f'supervise: {why}')
    return code

  def _run(self) -> int:
    failures = preemptions = 0
    best = progress.committed_step(self.workdir)
    attempt = 0
    while True:
      attempt += 1
      self.log.attempt = events.next_attempt(self.workdir)  # the attempt the job will record
      started = time.monotonic()
      code = self._attempt(attempt)
      step = progress.committed_step(self.workdir)
      fast = progress.local_step(self.workdir)  # the fast tier counts as progress too
      progressed, best = max(step, fast) > best, max(best, step, fast)
      if progressed:  # any attempt that advanced the checkpoint, a preempted one too
        failures = 0
      kind = verdict(code)
      reason = describe(code)
      record = dict(exit_code=code, verdict=kind.value, reason=reason, committed_step=step,
                    **({'local_step': fast} if fast else {}),
                    seconds=round(time.monotonic() - started, 3), supervisor_attempt=attempt)
      if kind is Verdict.DONE:
        return self._end(record, Exit.OK)
      if kind is Verdict.FINAL or self._stopping:
        return self._end(record, code, f'attempt {attempt} {reason}; not restarted ('
                         f'{"stopped by a signal" if self._stopping else "rerunning cannot help"})')
      if kind is Verdict.PREEMPTED:
        preemptions += 1
        if preemptions > self.max_preemptions:
          return self._end(record, code, f'giving up after {self.max_preemptions} preemptions; '
                           f'the last committed checkpoint is step {step}')
        wait = min(self.backoff, 1.0) * random.uniform(0.5, 1.5)
      else:
        failures += 1
        if failures > self.max_restarts:
          return self._end(record, code, f'giving up: attempt {attempt} {reason}, {failures} '
                           'failures in a row without a newer checkpoint (--max_restarts='
                           f'{self.max_restarts}); the last committed checkpoint is step {step}')
        wait = self.delay(failures)
      self.log.emit('exit', **record, restart_in=round(wait, 3))
      tier = f' (fast tier: step {fast})' if fast > step else ''
      self.say(f'supervise: attempt {attempt} {reason} at committed step {step}{tier}; '
               f'restarting in '
               f'{wait:.1f}s ({kind.value}; failures in a row {failures}/{self.max_restarts}, '
               f'preemptions {preemptions}/{self.max_preemptions})')
      deadline = time.monotonic() + wait
      while time.monotonic() < deadline and not self._stopping:
        time.sleep(min(0.1, wait))
      if self._stopping:  # a signal while waiting: no attempt runs to save, so stop now
        name = signal.Signals(self._stopping).name
        self.say(f'supervise: {name} while waiting to restart; attempt {attempt + 1} not started')
        return 128 + self._stopping



def main(argv):
  command = argv[1:]
  if not command:
    commandline.fail('supervise: no command to run; pass it after --, e.g. disttrain supervise -- '
                     'disttrain train --config=launch/configs/mnist_mlp.py --workdir=runs/digits')
  for name, flag in (('max_restarts', _MAX_RESTARTS), ('max_preemptions', _MAX_PREEMPTIONS),
                     ('backoff_seconds', _BACKOFF), ('max_backoff_seconds', _MAX_BACKOFF)):
    if not flag.value >= 0:  # nan too: it restarted with no wait
      commandline.fail(f'--{name}={flag.value} is not 0 or more; pass 0 or more')
  workdir = workdir_of(command)
  if not shutil.which(command[0]):
    commandline.fail(f'supervise: cannot run {command[0]!r} (not found, or not executable); '
                     'pass the launcher command after --, e.g. disttrain train ... or python '
                     'launch/train.py ...')
  if workdir is None or not workdir.strip():
    commandline.fail('supervise: the command has no --workdir=DIR; the supervisor reads the run\'s '
                     'committed checkpoints there to tell progress from failure')
  # As train reads it (--workdir=~/run is not expanded by the shell): events.jsonl went to ./~/run.
  workdir = urls.resolve(workdir)
  supervisor = Supervisor(command, workdir, _MAX_RESTARTS.value, _MAX_PREEMPTIONS.value,
                          _BACKOFF.value, _MAX_BACKOFF.value,
                          say=lambda line: print(line, file=sys.stderr, flush=True))
  sys.exit(supervisor.run())


if __name__ == '__main__':
  commandline.run(main, commandline.command_hint(
      'disttrain supervise --max_restarts=3 -- disttrain train --config=... --workdir=DIR'))

"""The exit-code contract of every disttrain process and launcher, and what a restart makes of it.

launch/train.py, launch/local_cluster.py, the hang watchdog, launch/supervise.py and the
Kubernetes pod failure policy (launch/k8s/) all read these numbers; a user's scheduler may too.
Nothing here imports jax: the supervisor and the launchers decide before any backend starts.
"""

import enum
import signal


class Exit(enum.IntEnum):
  """Exit statuses (a public interface: docs/command-line.md)."""
  OK = 0  # trained to the end, or stopped by a callback or early stopping
  FAILED = 1  # an unexpected error: a Python traceback
  BAD_INPUT = 2  # config, flags, data, checkpoint or URL: one `error:` line; rerunning cannot help
  HANG = 3  # the hang watchdog stopped a job in which no step finished for watchdog_seconds
  PREEMPTED = 75  # SIGTERM: a checkpoint was saved and has committed (EX_TEMPFAIL: try again)
  TIMEOUT = 124  # local_cluster's --timeout ended the job (as coreutils' timeout reports)
  INTERRUPTED = 130  # Ctrl-C: a checkpoint was saved; 128 + SIGINT, as a shell reports it


class Verdict(enum.Enum):
  """What a supervisor does after an attempt ends with a given status."""
  DONE = 'done'  # the job finished: stop, exit 0
  FINAL = 'final'  # bad input or the user's Ctrl-C: stop with the same status, never restart
  PREEMPTED = 'preempted'  # restart without spending the failure budget
  FAILURE = 'failure'  # a crash, a hang, a death by signal: restart, counted


def verdict(code: int) -> Verdict:
  """Exit 0 is done; 2 and 130 are final; 75 is a preemption; anything else is a failure."""
  if code == Exit.OK:
    return Verdict.DONE
  if code in (Exit.BAD_INPUT, Exit.INTERRUPTED):
    return Verdict.FINAL
  if code == Exit.PREEMPTED:
    return Verdict.PREEMPTED
  return Verdict.FAILURE


def shell_status(returncode: int) -> int:
  """subprocess's -N (killed by signal N) as a shell reports it, 128 + N; others unchanged."""
  return 128 - returncode if returncode < 0 else returncode


def describe(code: int) -> str:
  """'exited with code 3 (hang)', 'killed by SIGKILL', ... for one-line reports."""
  if code < 0 or (code > 128 and code - 128 in signal.valid_signals()
                  and code != Exit.INTERRUPTED):
    number = -code if code < 0 else code - 128
    try:
      return f'killed by {signal.Signals(number).name}'
    except ValueError:
      return f'killed by signal {number}'
  try:
    return f'exited with code {code} ({Exit(code).name.lower().replace("_", " ")})'
  except ValueError:
    return f'exited with code {code}'

"""Typed, one-line errors that users can catch; the launcher prints them without a traceback."""

import sys

from disttrain.exitcodes import Exit


def first_line(error: BaseException, limit: int = 300) -> str:
  """The first non-empty line of an exception's message, for one-line errors that quote it."""
  return next((line for line in str(error).splitlines() if line.strip()), '')[:limit]


class DisttrainError(Exception):
  """Base class: bad input from the user (config, flags, data, checkpoint)."""


class ConfigError(DisttrainError):
  """A config value is invalid or inconsistent with the machine."""


class ShardingError(DisttrainError):
  """A sharding rule cannot be applied to the mesh or to a parameter."""


class DataError(DisttrainError):
  """A data source is missing, malformed or too small."""


class CheckpointError(DisttrainError):
  """A checkpoint is missing, corrupt or does not fit the config."""


class NonFiniteError(DisttrainError):
  """Training produced a NaN or Inf."""


class Preempted(Exception):
  """SIGTERM: a checkpoint was saved at `step` and has committed; relaunch to resume."""
  exit_code = Exit.PREEMPTED  # 75, EX_TEMPFAIL: try again (the launcher exits with it)

  def __init__(self, step: int, path: str):
    super().__init__(f'preempted: saved a checkpoint at step {step} in {path}; relaunch with the '
                     'same --workdir to resume')
    self.step = step


class Interrupted(Preempted):
  """Ctrl-C (SIGINT): a checkpoint was saved at `step` and has committed; relaunch to resume."""
  exit_code = Exit.INTERRUPTED  # 130 = 128 + SIGINT, as a shell reports a Ctrl-C

  def __init__(self, step: int, path: str):
    Exception.__init__(self, f'interrupted: saved a checkpoint at step {step} in {path}; '
                             'relaunch with the same --workdir to resume')
    self.step = step


def exit_status(error: BaseException) -> int:
  """The status a process ends with for `error` (disttrain/exitcodes.py): 75 or 130 after a saved
  stop, 2 for bad input, sys.exit's own, 130 for a raw Ctrl-C, else 1 (a traceback)."""
  if isinstance(error, Preempted):
    return error.exit_code
  if isinstance(error, DisttrainError):
    return Exit.BAD_INPUT
  if isinstance(error, SystemExit):
    return error.code if isinstance(error.code, int) else int(error.code is not None)
  return Exit.INTERRUPTED if isinstance(error, KeyboardInterrupt) else Exit.FAILED


def one_line_errors(main):
  """An absl main whose DisttrainError becomes one `error:` line on stderr and exit status 2."""
  def run(argv):
    try:
      return main(argv)
    except DisttrainError as e:
      print(f'error: {type(e).__name__}: {e}', file=sys.stderr, flush=True)
      sys.exit(Exit.BAD_INPUT)
  return run

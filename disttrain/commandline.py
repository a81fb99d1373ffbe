"""What every `disttrain` subcommand does around absl: a bad flag is one `error:` line and exit 2,
and --help (or -h) exits 0 (absl alone prints a FATAL block and exits 1 for both).

  if __name__ == '__main__':
    commandline.run(one_line_errors(main))
"""

import os
import re
import sys
from typing import Callable, NoReturn

from absl import app, flags

from disttrain.exitcodes import Exit

_VALUE_ERROR = re.compile(r'^flag --(\S+?)=(.*?): (.*)$')
_HELP = {'--help', '-help', '-?', '--helpshort', '-helpshort', '--helpfull', '-helpfull',
         '--helpxml', '-helpxml'}  # absl's help flags (it has no -h: run() reads -h as --help)


def fail(message: str) -> NoReturn:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(Exit.BAD_INPUT)


def flag_error(error: flags.Error) -> str:
  """One line for absl's flag errors: a bad value, a missing required flag, an unknown flag."""
  message = str(error)
  if '\n' in message:  # e.g. a config file that raised: keep its trace, it points at the bug
    return message
  match = _VALUE_ERROR.match(message)
  if match is None:
    if isinstance(error, flags.UnrecognizedFlagError):
      return f'{message}; run with --helpfull to list the flags'
    return message
  name, value, reason = match.groups()
  flag = flags.FLAGS[name] if name in flags.FLAGS else None
  if 'must have a value other than None' in reason:
    text = ' '.join((flag.help or '').split()) if flag is not None else ''  # multi_ flags: 2 lines
    about = f' ({text.split(". ")[0].split(";")[0].rstrip(".")})' if text else ''
    return f'--{name} is required{about}; pass --{name}=<value>'
  kind = flag.flag_type() if flag is not None else 'valid'
  article = 'an' if kind[:1] in 'aeiou' else 'a'
  example = ''
  if flag is not None and flag.default is not None:
    example = f', e.g. --{name}={flag.default}'
  if kind in ('int', 'float') and _is_number(value):  # a number, but out of the flag's bounds
    return f'--{name}={value}: {reason}; pass one that is{example}'
  return (f'--{name}={value!r} is not {article} {kind} value ({reason}); pass {article} {kind}'
          f'{example}')


def output_file(flag: str, path: str) -> None:
  """Refuses, before any work, a local output file that could not be written."""
  if not path or path == '-' or '://' in path:
    return
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    fail(f'--{flag}={path!r} is a directory; pass a file path in it')
  if not os.path.isdir(folder):
    fail(f'--{flag}={path!r}: {folder} is not a directory; create it or pass another path')


def output_dir(flag: str, path: str) -> None:
  """Refuses, before any work, a local output folder that is a file."""
  if path and '://' not in path and os.path.exists(path) and not os.path.isdir(path):
    fail(f'--{flag}={path!r} is a file; pass a folder (created if missing)')


def in_flags(message: str, spellings: dict[str, str]) -> str:
  """A message of the config layer spoken in a command's own flags (its fix names them)."""
  for field, flag in spellings.items():
    message = message.replace(field, flag)
  return message


def _is_number(value: str) -> bool:
  try:
    float(value)
  except ValueError:
    return False
  return True


def parse(argv: list[str], hint: str = '') -> list[str]:
  """absl's parsing; an error is one line, with `hint` appended to an unknown flag's."""
  try:
    return flags.FLAGS(argv)
  except flags.UnrecognizedFlagError as e:
    fail(flag_error(e) + hint)
  except flags.Error as e:
    fail(flag_error(e))


def command_hint(example: str) -> Callable[[list[str]], list[str]]:
  """A parser for a launcher that runs a command after `--`: an unknown flag when there is no
  `--` is most likely the command's own, so the line says where it goes."""
  def parse_launcher(argv: list[str]) -> list[str]:
    hint = '' if '--' in argv else f'; the job\'s command and its flags go after --, e.g. {example}'
    return parse(argv, hint)
  return parse_launcher


def run(main: Callable[[list[str]], object],
        parser: Callable[[list[str]], list[str]] = parse) -> NoReturn:
  """app.run(main) with one-line flag errors (exit 2) and --help exiting 0."""
  def parse_with_help(argv: list[str]) -> list[str]:
    cut = argv.index('--') if '--' in argv else len(argv)
    # -h as most command lines read it; absl has no short help flag and no flag named h.
    argv = [*argv[:1], *('--help' if a == '-h' else a for a in argv[1:cut]), *argv[cut:]]
    own = argv[1:cut]
    try:
      return parser(argv)
    except SystemExit as e:  # absl's help flags exit 1 after printing the usage
      if e.code == 1 and any(arg.split('=', 1)[0] in _HELP for arg in own):
        sys.exit(Exit.OK)
      raise
  app.run(main, flags_parser=parse_with_help)

"""What data.workers=N needs before its worker processes start: room on the machine, and a main
script they can import without training again.

grain starts workers with multiprocessing's spawn: each imports the main script afresh. One that
calls disttrain.train at its top level trains again in every worker, which fails, and the parent
hangs writing the worker's start-up data into a pipe it still holds both ends of (CPython).
"""

import ast
import os
import sys

from disttrain.errors import ConfigError, DataError


def _available_memory() -> int | None:
  """Bytes a new process can take: MemAvailable counts the page cache it can reclaim, which
  MemFree (sysconf's AVPHYS_PAGES) leaves out."""
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
  except (ValueError, OSError, AttributeError):  # not Linux: the CPU bound only
    return None


def _is_main_test(test: ast.expr) -> bool:
  return ast.unparse(test).replace('"', "'") in ("__name__ == '__main__'",
                                                 "'__main__' == __name__")


def unguarded_line() -> tuple[str, int] | None:
  """(main script, line) where the main script's top level calls into this run outside
  `if __name__ == '__main__':`, or None (guarded, interactive, or `python -c`)."""
  main = sys.modules.get('__main__')
  path = getattr(main, '__file__', None)
  if not path or not path.endswith('.py'):
    return None  # spawn re-imports only a main script file
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None and not (frame.f_code.co_name == '<module>'
                                   and frame.f_globals is vars(main)):
    frame = frame.f_back
  if frame is None:
    return None
  line = frame.f_lineno
  try:
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read())
  except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
    return None
  guarded = any(isinstance(node, ast.If) and _is_main_test(node.test)
                and node.lineno <= line <= node.end_lineno for node in ast.walk(tree))
  return None if guarded else (path, line)


def check_workers(workers: int) -> None:
  """Refuses a worker count this machine cannot run (each worker is a Python process with jax
  and grain imported, ~200 MiB, that pays off only with a core of its own) and a main script
  the workers cannot import (module doc)."""
  if workers <= 0:
    return
  cpus = os.cpu_count() or 1
  limit, available = 4 * cpus, _available_memory()
  if available is not None:
    limit = min(limit, max(1, available // 2**28))
  if workers > limit:
    raise DataError(f'data.workers={workers} is more than this machine can run ({cpus} CPU '
                    f'cores, room for {limit} worker processes of ~256 MiB); use at most {limit}, '
                    f'about one per core')
  found = unguarded_line()
  if found:
    raise ConfigError(f'data.workers={workers}: {found[0]} starts training at its top level '
                      f'(line {found[1]}) and each worker process imports it; put that under '
                      "`if __name__ == '__main__':` or set data.workers=0")

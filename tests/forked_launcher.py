"""`python launch/train.py ARGS` for many short runs, each a fork of one process that has
imported the launcher's libraries already.

A launch that stops on bad input spends most of its 2-3 s importing jax, flax, grain and orbax;
dozens of bad-input cases paid that once each. The server imports them (never the launcher
module itself: the child runs it as __main__, as the script does, and defines its flags once)
and starts no jax backend, so each child still picks its own device count (--fake_devices) and
meets the same code as a fresh `python launch/train.py`: the script itself, sys.exit's status,
atexit handlers, stdout and stderr in their own files. Use it for runs that stop before training;
runs that train keep a fresh process (threads of their own, signals).
"""

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

SCRIPT = 'launch/train.py'
PRELOAD = ('jax', 'jax.numpy', 'flax.linen', 'optax', 'grain', 'orbax.checkpoint',
           'ml_collections', 'absl.app', 'disttrain.training.loop', 'disttrain.hf.adapters')


def _child(request: dict) -> None:
  os.environ.update(request['env'])
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the server's requests
  for fd, path in ((1, request['out']), (2, request['err'])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
  sys.argv = [SCRIPT, *request['args']]
  try:
    runpy.run_path(SCRIPT, run_name='__main__')
    code = 0
  except SystemExit as e:  # as the interpreter turns it into a status
    code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    if not isinstance(e.code, (int, type(None))):
      print(e.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def serve() -> None:
  """One JSON request a line on stdin ({args, env, out, err, timeout}); answers a line:
  {returncode, timed_out}."""
  for name in PRELOAD:
    __import__(name)
  print('ready', flush=True)
  for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
      _child(json.loads(line))
    deadline = time.monotonic() + json.loads(line)['timeout']
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
      time.sleep(0.02)
    if not done[0]:  # as subprocess.run's timeout would, without killing the server
      os.kill(pid, signal.SIGKILL)
      done = os.waitpid(pid, 0)
    print(json.dumps({'returncode': os.waitstatus_to_exitcode(done[1]),
                      'timed_out': not done[0]}), flush=True)


class Launcher:
  """`run(*args, env={...})` -> an object with returncode, stdout and stderr."""

  def __init__(self, root, env: dict):
    self._dir = tempfile.TemporaryDirectory(prefix='forked_launcher_')
    self._proc = subprocess.Popen(
        [sys.executable, '-c', 'from tests.forked_launcher import serve; serve()'], cwd=root,
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = self._proc.stdout.readline()
    assert ready == 'ready\n', f'the launcher server did not start: {ready!r}'
    self._count = 0

  def run(self, *args: str, env: dict | None = None, timeout: float = 120) -> SimpleNamespace:
    self._count += 1
    out, err = (os.path.join(self._dir.name, f'{self._count}.{n}') for n in ('out', 'err'))
    self._proc.stdin.write(json.dumps({'args': list(args), 'env': env or {}, 'out': out,
                                       'err': err, 'timeout': timeout}) + '\n')
    self._proc.stdin.flush()
    answer = json.loads(self._proc.stdout.readline())
    assert not answer['timed_out'], f'launch/train.py {" ".join(args)} ran past {timeout} s'
    with open(out, encoding='utf-8') as f_out, open(err, encoding='utf-8') as f_err:
      return SimpleNamespace(returncode=answer['returncode'], stdout=f_out.read(),
                             stderr=f_err.read())

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait(timeout=60)
    self._dir.cleanup()

r"""Run `disttrain train` as a multi-process jax.distributed job on this machine (CPU, gloo).

  disttrain cluster --num_processes=2 --devices_per_process=4 -- \
      --config=launch/configs/mnist_mlp.py --workdir=runs/mp
  (python launch/local_cluster.py ... is the same program)

Starts a coordinator on a free loopback port and P processes with D fake CPU devices each; every
output line is prefixed with its process id. If one process fails, the others are stopped and
this exits with its code and a one-line reason. SIGTERM is forwarded to every process (each saves
a preemption checkpoint at one agreed step; exit 75), and so is Ctrl-C (SIGINT: the same, exit
130; a second Ctrl-C stops everything at once). --timeout ends a hung job; the processes' own
hang watchdog (--config.watchdog_seconds) names the process that hung.
"""

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time

from absl import flags

from disttrain import commandline
from disttrain.exitcodes import Exit, describe, shell_status
from disttrain.parallel.distributed import free_port_pair, ignored

_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 2, 'Processes to start.')
_DEVICES = flags.DEFINE_integer('devices_per_process', 4, 'Fake CPU devices per process.')
_TIMEOUT = flags.DEFINE_float('timeout', 1800, 'Seconds before a hung job is stopped.')
_GRACE = flags.DEFINE_float('grace', 20, 'Seconds the others get to stop before SIGKILL.')

_PROGRAM = flags.DEFINE_string(
    'program', None, 'Script every process runs instead of the launcher (disttrain train); it '
    'must accept --fake_devices, --coordinator_address, --num_processes and --process_id.')
# Where the disttrain package lives: the processes import it from there, installed or not.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREEMPTED, INTERRUPTED = Exit.PREEMPTED, Exit.INTERRUPTED  # every process saved a checkpoint
_SAVED = (PREEMPTED, INTERRUPTED)


def _die_with(parent: int):
  """A preexec_fn: the child gets SIGKILL when this launcher dies, even by SIGKILL (Linux)."""
  libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith('linux') else None

  def preexec() -> None:
    if libc is not None:
      libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
      if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)
  return preexec


def _pump(index: int, stream) -> None:
  for line in stream:
    sys.stdout.write(f'[{index}] {line}')
    sys.stdout.flush()


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
  """SIGTERM every live process group, then SIGKILL what is left after `grace` seconds."""
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline and any(p.poll() is None for p in procs):
    time.sleep(0.1)
  for p in procs:
    try:
      os.killpg(p.pid, signal.SIGKILL)  # also any child a process left behind
    except ProcessLookupError:
      pass
    p.wait()


def run(num_processes: int, devices: int, train_args: list[str], timeout: float,
        grace: float, program: str | None = None) -> int:
  """Runs the job; returns the exit status for this launcher."""
  port = free_port_pair()
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  env['PYTHONPATH'] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get('PYTHONPATH')) if p)
  entry = [program] if program else ['-m', 'disttrain.launch.train']
  # --fake_devices decides the device count; the caller's other XLA flags reach every process.
  env['XLA_FLAGS'] = re.sub(r'--xla_force_host_platform_device_count=\d+', '',
                            env.get('XLA_FLAGS', '')).strip()
  procs = []
  for i in range(num_processes):
    cmd = [sys.executable, *entry, *train_args, f'--fake_devices={devices}',
           f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={num_processes}',
           f'--process_id={i}']
    # Own process group each, so that stopping a process also stops anything it started; and
    # no worker outlives a launcher that is killed outright (its own session would keep it).
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                  preexec_fn=_die_with(os.getpid())))
  # The output threads start only now: preexec_fn runs between fork and exec, which is safe
  # only while this process has no other threads.
  pumps = [threading.Thread(target=_pump, args=(i, p.stdout), daemon=True)
           for i, p in enumerate(procs)]
  for t in pumps:
    t.start()
  # When one process dies, JAX's coordination service soon aborts the others too: the first to
  # exit is the cause, so exit times are recorded as they happen, not found by polling later.
  exited: dict[int, float] = {}

  def wait_for(index: int, proc: subprocess.Popen) -> None:
    proc.wait()
    exited[index] = time.monotonic()
  for i, p in enumerate(procs):
    threading.Thread(target=wait_for, args=(i, p), daemon=True).start()

  def forward(signum, _):
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signum)
    if signum == signal.SIGINT:  # the next Ctrl-C takes the default way out, for everyone
      signal.signal(signal.SIGINT, lambda *_: (_stop(procs, 0), os._exit(INTERRUPTED)))
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)
              if not ignored(s)}  # a background job's ignored Ctrl-C stays ignored
  deadline = time.monotonic() + timeout
  try:
    while True:
      done = dict(exited)
      codes = [procs[i].returncode if i in done else None for i in range(num_processes)]
      failed = sorted(((i, c) for i, c in enumerate(codes) if c not in (None, 0, *_SAVED)),
                      key=lambda failure: done[failure[0]])
      # Also after SIGTERM: a process that died without its checkpoint leaves the others
      # waiting in a collective (or the roll call) until a timeout, not saving.
      if failed:
        index, code = failed[0]
        _stop(procs, grace)
        _finish(pumps)
        print(f'local_cluster: process {index} {describe(code)}; stopped the other '
              f'{num_processes - 1} process(es)', file=sys.stderr, flush=True)
        return shell_status(code)
      if all(c is not None for c in codes):
        _finish(pumps)
        if all(c == 0 for c in codes):
          return 0
        if all(c in _SAVED for c in codes):
          code = INTERRUPTED if INTERRUPTED in codes else PREEMPTED
          print(f'local_cluster: {"interrupted" if code == INTERRUPTED else "preempted"}; every '
                f'process saved its checkpoint (exit {code}), relaunch to resume',
                file=sys.stderr, flush=True)
          return code
        index, code = min(((i, c) for i, c in enumerate(codes) if c != 0),
                          key=lambda failure: done[failure[0]])
        print(f'local_cluster: process {index} {describe(code)}', file=sys.stderr, flush=True)
        return shell_status(code)
      if time.monotonic() > deadline:
        _stop(procs, grace)
        _finish(pumps)
        print(f'local_cluster: timed out after {timeout:.0f}s; stopped all {num_processes} '
              'processes (raise --timeout if the job needs longer)', file=sys.stderr, flush=True)
        return Exit.TIMEOUT
      time.sleep(0.1)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    _stop(procs, 0)  # never leave orphans, whatever happened above


def _finish(pumps) -> None:
  for t in pumps:
    t.join(timeout=5)


def main(argv):
  if _NUM_PROCESSES.value < 1 or _DEVICES.value < 1:
    commandline.fail(f'--num_processes={_NUM_PROCESSES.value} and --devices_per_process='
                     f'{_DEVICES.value} must both be >= 1')
  if not _TIMEOUT.value > 0 or not _GRACE.value >= 0:  # a negative timeout stopped it at once
    commandline.fail(f'--timeout={_TIMEOUT.value:g} must be > 0 and --grace={_GRACE.value:g} >= 0;'
                     ' pass seconds, e.g. --timeout=1800 --grace=20')
  for arg in argv[1:]:  # the launcher appends its own: absl would keep the last, silently
    name = re.match(r'--?([a-z_]+)', arg)
    if name and name[1] in _SET_BY_LAUNCHER:
      instead = _SET_BY_LAUNCHER[name[1]]
      commandline.fail(f'{arg} after -- is set by the launcher for each process; drop it'
                       + (f' and pass --{instead}=N before --' if instead else ''))
  sys.exit(run(_NUM_PROCESSES.value, _DEVICES.value, argv[1:], _TIMEOUT.value, _GRACE.value,
               _PROGRAM.value))


# What run() appends to every process's command line.
_SET_BY_LAUNCHER = {'fake_devices': 'devices_per_process', 'num_processes': 'num_processes',
                    'coordinator_address': '', 'process_id': ''}


if __name__ == '__main__':
  commandline.run(main, commandline.command_hint(
      'disttrain cluster --num_processes=2 -- --config=... --workdir=DIR'))

"""`disttrain supervise`'s decisions, on a stand-in job that exits as each test plans.

The stand-in (tests/configs/planned_job.py) reads its attempt number from DISTTRAIN_ATTEMPT,
commits the checkpoint step the plan gives it (a directory named by the step, as orbax leaves
a finished save) and exits with the planned status, or kills itself with a signal. The real
job (a SIGKILLed 2 x 4 cluster that the supervisor restarts to a bitwise-equal end) is in
tests/test_multiprocess.py.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from disttrain.exitcodes import Exit, Verdict, describe, verdict
from disttrain.launch import supervise
from disttrain.operating import events
from tests.conftest import ROOT

JOB = str(ROOT / 'tests' / 'configs' / 'planned_job.py')


def _supervise(tmp_path, plan: list, *flags: str, workdir_flag: str = ''):
  """Runs the supervisor over the stand-in with `plan` = [(status, committed step), ...], from
  tmp_path/cwd with HOME=tmp_path; the run's workdir is tmp_path/run."""
  workdir = tmp_path / 'run'
  env = dict(os.environ, PLAN=json.dumps(plan), HOME=str(tmp_path))
  os.makedirs(tmp_path / 'cwd', exist_ok=True)
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'launch' / 'supervise.py'), '--backoff_seconds=0.01', *flags,
       '--', sys.executable, JOB, workdir_flag or f'--workdir={workdir}'],
      cwd=tmp_path / 'cwd', env=env, capture_output=True, text=True, timeout=60, check=False)
  attempts = (workdir / 'attempts.txt').read_text().split() if (workdir / 'attempts.txt').exists() \
      else []
  exits = [e for e in events.read(str(workdir)) if e['event'] == 'exit']
  return proc, [int(a) for a in attempts], exits


def test_done_after_a_hang_and_a_death_by_signal(tmp_path):
  proc, attempts, exits = _supervise(tmp_path, [[Exit.HANG, None], [-9, None], [0, 30]])
  assert proc.returncode == 0, proc.stderr
  assert attempts == [1, 2, 3]
  assert [e['verdict'] for e in exits] == ['failure', 'failure', 'done']
  assert exits[0]['reason'] == 'exited with code 3 (hang)'
  assert exits[1]['reason'] == 'killed by SIGKILL' and exits[1]['exit_code'] == 137
  assert exits[2]['committed_step'] == 30
  assert 'restarting in' in proc.stderr


def test_a_home_relative_workdir_is_the_one_the_job_writes(tmp_path):
  """--workdir=~/run (a shell leaves ~ after '=' alone): the job expands it, and the supervisor's
  exit events and attempt count went to ./~/run/events.jsonl under its working directory."""
  proc, attempts, exits = _supervise(tmp_path, [[Exit.HANG, None], [0, 5]],
                                     workdir_flag='--workdir=~/run')
  assert proc.returncode == 0 and attempts == [1, 2], proc.stderr
  assert [e['verdict'] for e in exits] == ['failure', 'done']
  assert not os.path.exists(tmp_path / 'cwd' / '~')


@pytest.mark.parametrize('code', [Exit.BAD_INPUT, Exit.INTERRUPTED])
def test_bad_input_and_ctrl_c_are_never_restarted(tmp_path, code):
  proc, attempts, exits = _supervise(tmp_path, [[code, None], [0, None]])
  assert proc.returncode == code and attempts == [1], proc.stderr
  assert [e['verdict'] for e in exits] == ['final']
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and 'not restarted (rerunning cannot help)' in lines[0], lines


def test_a_job_that_always_crashes_stops_after_max_restarts_with_one_line(tmp_path):
  proc, attempts, exits = _supervise(tmp_path, [[1, None]] * 10, '--max_restarts=2')
  assert proc.returncode == 1 and attempts == [1, 2, 3]
  assert [e.get('restart_in') is not None for e in exits] == [True, True, False]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith('supervise: giving up: attempt 3 exited with code 1 (failed), 3 failures '
                         'in a row without a newer checkpoint (--max_restarts=2)'), last


def test_preemptions_do_not_spend_the_failure_budget(tmp_path):
  plan = [[Exit.PREEMPTED, 10], [Exit.PREEMPTED, 10], [Exit.PREEMPTED, 10], [0, 20]]
  proc, attempts, exits = _supervise(tmp_path, plan, '--max_restarts=0')
  assert proc.returncode == 0 and attempts == [1, 2, 3, 4], proc.stderr
  assert [e['verdict'] for e in exits] == ['preempted'] * 3 + ['done']
  proc, attempts, _ = _supervise(tmp_path / 'b', plan, '--max_preemptions=2')
  assert proc.returncode == Exit.PREEMPTED and attempts == [1, 2, 3]
  assert 'giving up after 2 preemptions' in proc.stderr


def test_progress_resets_the_failure_count(tmp_path):
  """max_restarts=1: a second failure in a row ends it, unless the failed attempt had committed
  a newer checkpoint first."""
  plan = [[1, None], [1, 10], [1, 20], [1, 30], [0, 40]]
  proc, attempts, exits = _supervise(tmp_path, plan, '--max_restarts=1')
  assert proc.returncode == 0 and attempts == [1, 2, 3, 4, 5], proc.stderr
  assert [e['committed_step'] for e in exits] == [0, 10, 20, 30, 40]
  proc, attempts, _ = _supervise(tmp_path / 'b', [[1, None], [1, None], [0, 10]],
                                 '--max_restarts=1')
  assert proc.returncode == 1 and attempts == [1, 2]
  # A preempted attempt that advanced the checkpoint resets the count too (it did not).
  proc, attempts, _ = _supervise(tmp_path / 'c', [[1, None], [Exit.PREEMPTED, 10], [1, 10],
                                                  [0, 20]], '--max_restarts=1')
  assert proc.returncode == 0 and attempts == [1, 2, 3, 4], proc.stderr


def test_backoff_doubles_with_jitter_up_to_the_cap():
  sup = supervise.Supervisor(['true'], '/nonexistent', 3, 3, backoff=2.0, max_backoff=10.0)
  for failures, base in [(1, 2.0), (2, 4.0), (3, 8.0), (4, 10.0), (9, 10.0), (5000, 10.0)]:
    delays = [sup.delay(failures) for _ in range(200)]  # 5000: 2.0 ** 4999 overflowed a float
    assert base * 0.5 <= min(delays) < max(delays) <= min(base * 1.5, 10.0), (failures, delays)


def test_a_signal_during_the_backoff_stops_the_supervisor_with_its_status(tmp_path):
  workdir = tmp_path / 'run'
  proc = subprocess.Popen(
      [sys.executable, 'launch/supervise.py', '--backoff_seconds=60', '--',
       sys.executable, JOB, f'--workdir={workdir}'],
      cwd=ROOT, env=dict(os.environ, PLAN='[[1, null], [0, 5]]'), stderr=subprocess.PIPE,
      text=True)
  first = proc.stderr.readline()
  assert 'restarting in' in first, first
  proc.send_signal(signal.SIGTERM)
  rest = proc.communicate(timeout=30)[1]
  assert proc.returncode == 128 + signal.SIGTERM, (first, rest)  # it was the failed attempt's 1
  assert rest.strip().splitlines() == [
      'supervise: SIGTERM while waiting to restart; attempt 2 not started']
  assert (workdir / 'attempts.txt').read_text().split() == ['1']


@pytest.mark.parametrize('args,message', [
    (['--max_restarts=-1', '--', 'true', '--workdir=x'], '--max_restarts=-1 is not 0 or more'),
    (['--backoff_seconds=nan', '--', 'true', '--workdir=x'],  # restarted with no wait
     '--backoff_seconds=nan is not 0 or more'),
    ([], 'no command to run'),
    (['--max_restarts=abc', '--', 'true', '--workdir=x'], "--max_restarts='abc' is not an int"),
    (['disttrain', 'train', '--config=c.py', '--workdir=x'],  # no --: train's flags reach absl
     "Unknown command line flag 'config'; run with --helpfull to list the flags; the job's "
     'command and its flags go after --, e.g. disttrain supervise'),
    (['--', 'true'], 'the command has no --workdir=DIR'),
    (['--', '/nonexistent/train', '--workdir=x'], "cannot run '/nonexistent/train'"),
])
def test_bad_supervisor_flags_are_one_line_and_exit_2(args, message):
  proc = subprocess.run([sys.executable, 'launch/supervise.py', *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=60, check=False)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr
  assert lines[0].startswith('error: ') and message in lines[0], lines


def test_exit_code_contract():
  assert [verdict(c) for c in (0, 2, 130, 75, 3, 1, 137, -9)] == [
      Verdict.DONE, Verdict.FINAL, Verdict.FINAL, Verdict.PREEMPTED] + [Verdict.FAILURE] * 4
  assert describe(-15) == describe(143) == 'killed by SIGTERM'
  assert describe(130) == 'exited with code 130 (interrupted)'

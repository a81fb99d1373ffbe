"""disttrain goodput on an event log whose every figure is known."""

import json
import os
import subprocess
import sys

from disttrain.operating import goodput
from tests.conftest import ROOT


def _breakdown(wall: float, **seconds) -> dict:
  phases = {name: {'seconds': seconds.get(name, 0.0)} for name in
            ('setup', 'compile', 'data', 'step', 'records', 'eval', 'checkpoint', 'profile')}
  phases['other'] = {'seconds': wall - sum(seconds.values())}
  return {**phases, 'wall_seconds': wall}


def _log(tmp_path, supervised: bool = True) -> None:
  """Attempt 1 starts at t=100, trains steps 1-35 at 1 s each after 10 s of start-up, commits a
  checkpoint at step 30 and is SIGKILLed at t=150 (its records reach step 35); the supervisor
  restarts it after 5 s; attempt 2 starts at t=158, resumes at 30 and ends at step 100 at t=250."""
  log = [
      {'time': 100.0, 'event': 'start', 'attempt': 1},
      {'time': 150.0, 'event': 'exit', 'attempt': 1, 'reason': 'killed by SIGKILL',
       'restart_in': 5.0},
      {'time': 158.0, 'event': 'start', 'attempt': 2},
      {'time': 160.0, 'event': 'restore', 'attempt': 2, 'step': 30, 'trained_through': 35},
      {'time': 250.0, 'event': 'end', 'attempt': 2, 'step': 100, 'stopped_by': '',
       'breakdown': _breakdown(92.0, setup=8.0, compile=4.0, data=3.0, step=70.0, checkpoint=5.0,
                               eval=1.0)},
      {'time': 250.5, 'event': 'exit', 'attempt': 2, 'reason': 'exited with code 0 (ok)'},
  ]
  if not supervised:  # killed and restarted by a scheduler: no exit events
    log = [e for e in log if e['event'] != 'exit']
  (tmp_path / 'events.jsonl').write_text(''.join(json.dumps(e) + '\n' for e in log))


def test_an_attempt_killed_without_a_supervisor_lasts_until_the_next_start(tmp_path):
  """With no exit event, attempt 1 fell out of every category (97 s of 150 accounted)."""
  _log(tmp_path, supervised=False)
  report = goodput.report(str(tmp_path))
  s = report['seconds']
  assert report['attempts'][0]['exit'] == 'killed (no end or exit event)'
  assert s['productive'] == 100.0 and s['idle_between_attempts'] == 0.0
  assert s['killed_other'] == 58.0 - 30.0 - 5.0  # its time up to attempt 2's start
  assert abs(sum(s.values()) - report['wall_seconds']) < 1e-6


def test_the_report_accounts_for_every_second(tmp_path):
  _log(tmp_path)
  report = goodput.report(str(tmp_path))
  s = report['seconds']
  assert report['wall_seconds'] == 150.0 and report['mean_step_seconds'] == 1.0  # 70 s / 70 steps
  first, second = report['attempts']
  assert (first['first_step'], first['last_step'], first['lost_steps']) == (0, 35, 5)
  assert (second['first_step'], second['last_step'], second['exit']) == (30, 100, 'done')
  assert s['lost_steps'] == 5.0 and s['idle_between_attempts'] == 8.0
  assert s['productive'] == 30.0 + 70.0  # attempt 1's 30 kept steps, attempt 2's 70
  assert s['killed_other'] == 50.0 - 30.0 - 5.0  # attempt 1's start-up and what was not steps
  assert (s['startup_and_compile'], s['checkpoint'], s['data'], s['eval']) == (12.0, 5.0, 3.0, 1.0)
  assert abs(sum(s.values()) - report['wall_seconds']) < 1e-6
  assert report['fractions']['productive'] == round(100 / 150, 4)


def test_an_attempt_dead_in_set_up_and_a_preempted_one_are_costed_as_they_went(tmp_path):
  """As _log, with `training` events, but a second attempt killed 5 s into set-up (an OOM at
  compilation) before the one that resumes; then a preempted attempt with its own breakdown.
  Attempt 1's 5 lost steps and 30 kept ones were charged to the dead one (categories summing to
  187 s of a 157 s wall), and the preempted one's time all went to killed_other."""
  log = [
      {'time': 100.0, 'event': 'start', 'attempt': 1},
      {'time': 110.0, 'event': 'training', 'attempt': 1, 'step': 0},
      {'time': 150.0, 'event': 'exit', 'attempt': 1, 'reason': 'killed by SIGKILL'},
      {'time': 152.0, 'event': 'start', 'attempt': 2},
      {'time': 157.0, 'event': 'exit', 'attempt': 2, 'reason': 'killed by SIGKILL'},
      {'time': 158.0, 'event': 'start', 'attempt': 3},
      {'time': 160.0, 'event': 'restore', 'attempt': 3, 'step': 30, 'trained_through': 35},
      {'time': 162.0, 'event': 'training', 'attempt': 3, 'step': 30},
      {'time': 250.0, 'event': 'end', 'attempt': 3, 'step': 100, 'error': 'Preempted',
       'breakdown': _breakdown(92.0, setup=8.0, compile=4.0, data=3.0, step=70.0, checkpoint=5.0,
                               eval=1.0)},
  ]
  (tmp_path / 'events.jsonl').write_text(''.join(json.dumps(e) + '\n' for e in log))
  report = goodput.report(str(tmp_path))
  s, (first, dead, third) = report['seconds'], report['attempts']
  assert (first['last_step'], first['lost_steps'], dead['lost_steps']) == (35, 5, 0)
  assert (third['exit'], third['time']['step']) == ('Preempted', {'seconds': 70.0})
  assert s['productive'] == 30.0 + 70.0 and s['lost_steps'] == 5.0
  assert s['killed_other'] == (50.0 - 30.0 - 5.0) + 5.0  # attempt 1's rest, attempt 2 whole
  assert abs(sum(s.values()) - report['wall_seconds']) < 1e-6


def test_a_killed_attempt_is_costed_at_most_as_long_as_it_lasted(tmp_path):
  """Attempt 1 trains 1620 steps and is killed at 12 s; attempt 2 resumes from 1600, trains one
  slow step (0.5 s) and is preempted. Its mean step priced attempt 1's 1600 kept steps at 800 s:
  goodput far above 100%. Now at most attempt 1's 12 s; the categories add up to the wall time."""
  log = [{'time': 0.0, 'event': 'start', 'attempt': 1},
         {'time': 1.0, 'event': 'training', 'attempt': 1},
         {'time': 12.0, 'event': 'start', 'attempt': 2},
         {'time': 13.0, 'event': 'restore', 'attempt': 2, 'step': 1600, 'trained_through': 1620},
         {'time': 14.0, 'event': 'training', 'attempt': 2},
         {'time': 15.0, 'event': 'end', 'attempt': 2, 'step': 1601, 'error': 'Preempted',
          'breakdown': _breakdown(3.0, setup=1.0, compile=1.0, step=0.5, checkpoint=0.5)}]
  (tmp_path / 'events.jsonl').write_text(''.join(json.dumps(e) + '\n' for e in log))
  report = goodput.report(str(tmp_path))
  s = report['seconds']
  assert s['productive'] + s['lost_steps'] <= 12.0 + 0.5, s  # attempt 1's 12 s, attempt 2's step
  assert abs(sum(s.values()) - report['wall_seconds']) < 1e-3, (s, report['wall_seconds'])
  assert s['lost_steps'] == round(20 / 1620 * 12.0, 3) and s['productive'] == round(
      1600 / 1620 * 12.0 + 0.5, 3), s  # attempt 1's 12 s shared as its steps were


def test_the_command_prints_the_table_and_writes_json(tmp_path):
  _log(tmp_path)
  # '~/run' as a script quotes it: the table reads the directory the path resolves to.
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'goodput', f'~/{tmp_path.name}',
                         f'--json={tmp_path / "goodput.json"}'], cwd=ROOT, capture_output=True,
                        env={**os.environ, 'HOME': str(tmp_path.parent)}, text=True, timeout=60,
                        check=False)
  assert proc.returncode == 0, proc.stderr
  assert 'wall 150.0s, goodput 66.7%' in proc.stdout and 'killed by SIGKILL' in proc.stdout
  written = json.loads((tmp_path / 'goodput.json').read_text())
  assert written['seconds']['lost_steps'] == 5.0
  # A killed attempt has no breakdown; one that ended reports its own, as --help says.
  assert written['attempts'][0]['time'] is None
  assert written['attempts'][1]['time']['step'] == {'seconds': 70.0}
  (tmp_path / 'odd').mkdir()  # an event without its time; a file given as the run directory
  (tmp_path / 'odd' / 'events.jsonl').write_text('[1, 2]\n{"event": "start", "attempt": 1}\n')
  for run_dir, said in [(tmp_path / 'nothing', 'has no start event'),
                        (tmp_path / 'odd', "holds an event that is not disttrain's (KeyError: "
                                           "'time')"),
                        (tmp_path / 'goodput.json', 'NotADirectoryError')]:  # all tracebacks
    bad = subprocess.run([sys.executable, '-m', 'disttrain', 'goodput', str(run_dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and bad.stderr.count('\n') == 1 and said in bad.stderr, bad.stderr

"""data.mixture: weighted sources drawn by a deterministic schedule, resumed bit for bit.

The schedule keeps every window of rows within one row of the weights (two sources); stages
switch at their step; the iterator resumes exactly across a stage boundary, with worker
processes, from 2 processes to 1, and continues each source's draws when the weights change at
a restart (and goes on so at the next restart); mixture_exhausted='stop' ends the run, and its
relaunches, before a repeat; the launcher's SIGKILL-and-relaunch run equals the uninterrupted
one; bad input is one line and exit status 2.
"""

import dataclasses
import json
import os
import subprocess
import sys

import grain
import numpy as np
import pytest

import disttrain
from disttrain import config as config_lib
from disttrain.data import mixture as mixture_lib, sources
from disttrain.data.batches import TrainIterator
from disttrain.data.mixture import Mixture, MixtureRecords
from disttrain.data.records import Data, Records
from disttrain.errors import ConfigError, DataError
from disttrain.parallel import mesh as mesh_lib
from tests import helpers, mp_mixture
from tests.conftest import ROOT, subprocess_env


@dataclasses.dataclass(frozen=True)
class _Noise(grain.transforms.RandomMap):
  def random_map(self, example, rng):
    return {**example, 'noise': rng.normal(size=3).astype(np.float32)}


def _rows(source: int, n: int) -> dict:
  return {'x': np.repeat(1000 * source + np.arange(n, dtype=np.int32)[:, None], 4, axis=1)}


def _sources_of(records: MixtureRecords, rows) -> np.ndarray:
  return records.read(np.asarray(rows))['x'][:, 0] // 1000


def test_every_window_holds_each_source_within_one_row_of_its_weight():
  records = MixtureRecords(Mixture({'web': _rows(0, 1000), 'code': _rows(1, 1000)},
                                   {'web': 0.7, 'code': 0.3}), 10, seed=0)
  x = records.read(np.arange(1000))['x'][:, 0]
  is_web = np.concatenate([[0], np.cumsum(x // 1000 == 0)])
  for length in range(1, 1001):  # every window of every length
    web = is_web[length:] - is_web[:-length]
    assert np.abs(web - 0.7 * length).max() <= 1, length
  assert is_web[-1] == 700
  # Each source walks its own shuffled epoch: no example twice, not in file order.
  web_ids = x[x // 1000 == 0]
  assert len(set(web_ids)) == 700 and not np.array_equal(web_ids, np.sort(web_ids))
  assert records.shares(0, 100) == {'mixture/web': 0.7, 'mixture/code': 0.3}
  # Weights are relative: tiny ones are the same mixture (they were rounded to 1/1000 first:
  # 0.0007 : 0.0003 drew web only, 0.0003 : 0.0001 divided by zero); one under 1e-5 still draws.
  tiny = MixtureRecords(Mixture({'web': _rows(0, 1000), 'code': _rows(1, 1000)},
                                {'web': 0.0007, 'code': 0.0003}), 10, seed=0)
  assert np.array_equal(tiny.read(np.arange(1000))['x'][:, 0] // 1000, x // 1000)
  assert MixtureRecords(Mixture({'a': _rows(0, 10), 'b': _rows(1, 10)}, {'a': 3e-4, 'b': 1e-4}),
                        10, 0).shares(0, 100) == {'mixture/a': 0.75, 'mixture/b': 0.25}
  # Random transforms draw per source: example i of web and of code got one draw (same seed).
  noisy = lambda v: Data({'x': np.full((50, 1), v, np.int32)}, [_Noise()])
  out = MixtureRecords(Mixture({'web': noisy(0), 'code': noisy(1)}, {'web': 1, 'code': 1}), 10,
                       seed=0).read(np.arange(100))
  by_id = {int(i): n.tolist() for i, n in zip(out['_id'], out['noise'])}
  assert all(by_id[i] != by_id[50 + i] for i in range(50))
  rare = MixtureRecords(Mixture({'a': _rows(0, 10), 'b': _rows(1, 10)}, {'a': 1, 'b': 1e-7}),
                        10, 0)
  assert rare.rows_before(20_001)[1] == 2
  # Weights a small period only approximates drew 999 : 1 for 0.9994 : 0.0006 (67 % over).
  near = MixtureRecords(Mixture({'a': _rows(0, 10), 'b': _rows(1, 10)}, {'a': 0.9994, 'b': 6e-4}),
                        10, 0)
  assert near.rows_before(10_000)[1] == 60  # of 100,000 rows


def test_stages_switch_at_their_step_and_stop_ends_before_a_source_repeats():
  mixture = Mixture({'a': _rows(0, 100), 'b': _rows(1, 40)}, {'a': 0.7, 'b': 0.3},
                    ((6, {'a': 0.2, 'b': 0.8}),), exhausted='stop')
  records = MixtureRecords(mixture, 10, seed=0)
  source = _sources_of(records, np.arange(100))
  # Steps 1-5 (rows 0-49) at 0.3, from step 6 on at 0.8.
  assert (source[:50] == 1).sum() == 15 and (source[50:] == 1).sum() == 40
  assert records.shares(5, 6) == {'mixture/a': 0.2, 'mixture/b': 0.8}
  # b: 15 rows by step 5, 8 a step after: 39 <= 40 by step 8, 47 by step 9.
  assert records.last_step(num_steps=100) == 8 and records.last_step(8) is None
  assert records.last_step(100, multiple=3) == 6
  totals = records.totals(8)
  assert totals['b'] == {'examples': 40, 'rows': 39, 'tokens': 0, 'epochs': 0.975}



def test_stop_ends_the_run_before_a_repeat_and_a_relaunch_trains_no_step_more(tmp_path, capsys):
  """mixture_exhausted='stop' in the loop: the run ends at records.last_step with a checkpoint;
  relaunched with more steps it trains none (each relaunch used to train one on repeated rows)
  and says how to go on."""
  rng = np.random.default_rng(0)
  digits = lambda n: {'image': rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
                      'label': rng.integers(0, 10, n).astype(np.int32)}
  mixture = lambda: Mixture({'a': digits(40), 'b': digits(16)}, {'a': 0.5, 'b': 0.5},
                            exhausted='stop')
  cfg = lambda steps: helpers.make_config(global_batch_size=8, num_train_steps=steps,
                                          log_every_steps=1, eval_every_steps=0)
  first = disttrain.train(cfg(20), str(tmp_path), devices=helpers.devices(1), train_data=mixture())
  end = MixtureRecords(mixture(), 8, 0).last_step(20)
  assert first.step == end == 4 and first.stopped_by.startswith('data: ')  # b's 16 rows: 4 steps
  again = disttrain.train(cfg(30), str(tmp_path), devices=helpers.devices(1),
                          train_data=mixture())
  assert again.step == end and again.stopped_by == first.stopped_by
  assert [r['step'] for r in helpers.metrics_records(tmp_path)] == [1, 2, 3, 4]
  assert "relaunch with data.mixture_exhausted='repeat' to go on" in capsys.readouterr().out


def _iterator(mixture, workers=0):
  sharding = mesh_lib.batch_sharding(mesh_lib.build(config_lib.MeshConfig(data=8),
                                                    helpers.devices(8)))
  return TrainIterator(MixtureRecords(mixture, mp_mixture.BATCH, 0), mp_mixture.BATCH, 0,
                       sharding, workers=workers)


def _read(batches, n: int) -> list[list[int]]:
  return [np.asarray(next(batches)['x'])[:, 0].tolist() for _ in range(n)]


@pytest.mark.slow
def test_two_processes_resume_in_one_with_workers_across_stages_and_changed_weights(tmp_path):
  proc = subprocess.run(
      [sys.executable, 'launch/local_cluster.py', '--num_processes=2', '--devices_per_process=4',
       '--timeout=240', '--program=tests/mp_mixture.py', '--', f'--out={tmp_path}'],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  job = json.loads((tmp_path / 'mixture.json').read_text())
  uninterrupted = _iterator(mp_mixture.mixture())
  expected = _read(uninterrupted, mp_mixture.STEPS)
  assert job['batches'] == expected[:mp_mixture.STEPS_BEFORE]  # 2 processes x 2 workers
  resumed = _iterator(mp_mixture.mixture(), workers=2)
  resumed.set_state(job['state'])
  assert resumed.changed == ''
  assert _read(resumed, mp_mixture.STEPS - mp_mixture.STEPS_BEFORE) == \
      expected[mp_mixture.STEPS_BEFORE:]  # bit for bit, across the stage at step 9
  resumed.close()
  # New weights from the restart on: every row from a, continuing a's draws (none repeated).
  # (Step 4's stage edited too: a fresh schedule of these weights would have other draws.)
  edited = lambda: Mixture(mp_mixture.mixture().sources, {'a': 0.7, 'b': 0.3},
                           ((4, {'a': 0.5, 'b': 0.5}), (7, {'a': 1.0})))
  changed = _iterator(edited())
  changed.set_state(job['state'])
  assert 'data.mixture changed since the checkpoint: from step 7' in changed.changed
  after = np.array(_read(changed, 2))
  before = np.array(expected[:mp_mixture.STEPS_BEFORE])
  a_before = before[before < 1000]
  assert (after < 1000).all() and not set(after.ravel()) & set(a_before)
  assert len(a_before) + after.size <= 100  # still a's first epoch: nothing drawn twice
  # Resumed a second time with the edited mixture: its schedule goes on, not a fresh one.
  again = _iterator(edited())
  again.set_state(json.loads(json.dumps(changed.get_state())))
  assert again.changed == '' and _read(again, 2) == _read(changed, 2)


def test_bad_mixtures_are_one_line_config_or_data_errors(tmp_path):
  def error(**data) -> str:
    cd = config_lib.defaults()
    cd.data.name, cd.model.name = 'tokens', 'gpt'
    for key, value in data.items():
      cd.data[key] = value
    with pytest.raises((ConfigError, DataError)) as e:
      sources.build(config_lib.from_config_dict(cd))
    assert '\n' not in str(e.value)
    return str(e.value)
  one = tmp_path / 'one.bin'
  np.arange(4000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(one)
  assert 'must be >= 0 and not all 0; fix' in error(mixture=f'a={one}:0.5;b={one}:-1')
  assert 'give some source a weight' in error(mixture=f'a={one}:0;b={one}:0')
  assert "data.mixture source 'b'" in error(mixture=f'a={one}:1;b={tmp_path}/none*.bin:1')
  assert 'is not NAME=GLOB:WEIGHT' in error(mixture=f'a={one}')
  assert 'must be positive and increasing' in error(
      mixture=f'a={one}:1;b={one}:1', mixture_stages='20:a=1;10:b=1')
  assert "names 'c', not a source" in error(mixture=f'a={one}:1;b={one}:1',
                                            mixture_stages='20:c=1')
  for typo in ('20:a=0.5,b0.5', '20:a=0.2,a=0.9'):  # b was dropped, a's second weight kept
    assert 'is not STEP:NAME=WEIGHT,... with each name once' in error(
        mixture=f'a={one}:1;b={one}:1', mixture_stages=typo)
  # Held out or from eval_files, 0 meaning no eval, beside a mixture (eval_examples=0 was refused).
  for eval_files, eval_examples, sets in (('', 0, []), ('', 16, ['a', 'b']),
                                           (str(one), -1, ['eval'])):
    cd = config_lib.defaults()
    cd.data.name, cd.model.name, cd.data.mixture = 'tokens', 'gpt', f'a={one}:1;b={one}:1'
    cd.data.eval_files, cd.data.eval_examples = eval_files, eval_examples
    built = sources.build(config_lib.from_config_dict(cd))
    assert sorted(built['eval_data'] or {}) == sets
  # Stages built in Python are checked as the flag's are.
  for stages, message in ((((4, {'a': -1.0, 'b': 1.0}),), 'must be >= 0'),
                          (((4, {'a': 0.0, 'b': 0.0}),), 'give some source a weight'),
                          (((8, {'a': 1.0}), (4, {'b': 1.0})), 'positive and increasing'),
                          ((('1k', {'a': 1.0}),), "step '1k' is not a whole number"),  # tracebacks
                          (((10.7, {'a': 1.0}),), 'step 10.7 is not a whole number')):  # was 10
    with pytest.raises(ConfigError, match=message):
      MixtureRecords(Mixture({'a': _rows(0, 10), 'b': _rows(1, 10)}, {'a': 1, 'b': 1}, stages),
                     4, 0)
  with pytest.raises(ConfigError, match='the mixture has no sources'):  # an IndexError
    MixtureRecords(Mixture({}, {}), 4, 0)
  assert 'drop data.train_files' in error(mixture=f'a={one}:1', train_files=str(one))
  cd = config_lib.defaults()  # 'stop' from the config (each source's own config refused it)
  cd.data.name, cd.model.name, cd.data.mixture = 'tokens', 'gpt', f'a={one}:1;b={one}:1'
  cd.data.mixture_exhausted = 'stop'
  assert sources.build(config_lib.from_config_dict(cd))['train_data'].exhausted == 'stop'
  with pytest.raises(DataError, match="mixture sources 'a' and 'b' give different rows"):
    MixtureRecords(Mixture({'a': _rows(0, 10), 'b': {'x': np.zeros((10, 3), np.int32)}},
                           {'a': 1, 'b': 1}), 4, 0)
  # A checkpoint of a mixture run resumed by a one-source run, and the other way round.
  mixed = _iterator(mp_mixture.mixture())
  sharding = mesh_lib.batch_sharding(mesh_lib.build(config_lib.MeshConfig(data=8),
                                                    helpers.devices(8)))
  one_source = TrainIterator(Records(_rows(0, 100), 'train', 0), mp_mixture.BATCH, 0, sharding)
  with pytest.raises(DataError, match='read a data.mixture, this run one source; resume with'):
    one_source.set_state(mixed.get_state())
  with pytest.raises(DataError, match='read one source, this run a data.mixture; resume with'):
    mixed.set_state(one_source.get_state())
  # The tuple form a config file may give is the same mixture.
  assert mixture_lib.parse_sources((('a', str(one), 0.7), ('b', str(one), 0.3))) == \
      mixture_lib.parse_sources(f'a={one}:0.7;b={one}:0.3')


def _env() -> dict:
  return subprocess_env()


STEPS = 12


def _train(tmp_path, workdir, workers: int, every: int = 0, log_every: int = 1) -> list[str]:
  a, b = tmp_path / 'a.bin', tmp_path / 'b.bin'
  if not a.exists():  # two corpora the model tells apart: low ids and high ids
    rng = np.random.default_rng(0)
    rng.integers(0, 128, 20_000).astype(np.uint16).tofile(a)
    rng.integers(128, 256, 9_000).astype(np.uint16).tofile(b)
  return [sys.executable, 'launch/train.py', '--config=launch/configs/llama.py',
          f'--workdir={workdir}', '--fake_devices=8', '--config.data.name=tokens',
          f'--config.data.mixture=low={a}:0.7;high={b}:0.3',
          '--config.data.mixture_stages=6:low=0.2,high=0.8', '--config.data.eval_examples=16',
          f'--config.data.workers={workers}', '--config.data.seq_len=32',
          '--config.global_batch_size=16', '--config.model.num_layers=1',
          f'--config.num_train_steps={STEPS}', f'--config.log_every_steps={log_every}',
          f'--config.checkpoint_every_steps={every}', '--config.eval_every_steps=0',
          '--config.warmup_steps=2']


def _records(workdir) -> dict[int, dict]:
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return {r['step']: r for r in map(json.loads, f) if r['split'] == 'train'}


@pytest.mark.slow
def test_sigkill_with_workers_across_a_stage_resumes_to_the_uninterrupted_run(tmp_path):
  whole = tmp_path / 'whole'
  proc = subprocess.run(_train(tmp_path, whole, workers=0), cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  expected = _records(whole)
  low = [round(expected[s]['mixture/low'] * 16) for s in range(1, STEPS + 1)]  # rows per step
  assert set(low[:5]) <= {11, 12} and sum(low[:5]) == 56  # 0.7 of 80 rows, every step 0.7 x 16
  assert set(low[5:]) <= {3, 4} and sum(low[5:]) in (22, 23)  # 0.2 of 112 from step 6 on
  info = json.loads((whole / 'run.json').read_text())
  mix = info['data']['train']['mixture']
  assert mix['low']['rows'] + mix['high']['rows'] == STEPS * 16
  assert mix['high']['tokens'] == 32 * mix['high']['rows'] and set(info['data']) >= {'low', 'high'}
  # Records every 3 steps: the one after the resume at 4 covers steps 4-6 (4 restored from the
  # checkpoint), its shares too.
  killed = tmp_path / 'killed'
  command = _train(tmp_path, killed, workers=2, every=4, log_every=3)
  helpers.sigkill_after_checkpoint(command, killed, 4, _env(), ROOT)
  proc = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'resumed from step' in proc.stdout
  actual = _records(killed)
  for step in (6, 9, 12):  # across the stage at step 6, read by 2 workers
    window = range(step - 2, step + 1)
    assert actual[step]['loss'] == pytest.approx(np.mean([expected[s]['loss'] for s in window]),
                                                 rel=1e-6), step
    assert actual[step]['mixture/high'] == pytest.approx(
        np.mean([expected[s]['mixture/high'] for s in window]), abs=1e-9), step


def test_plot_draws_the_shares_and_downstream_scores_beside_the_loss(tmp_path):
  pytest.importorskip('matplotlib')
  from matplotlib import image  # pylint: disable=g-import-not-at-top
  records = [{'step': s, 'split': 'train', 'loss': 3.0 / s, 'mixture/web': 0.7,
              'mixture/code': 0.3} for s in range(1, 5)]
  records.append({'step': 4, 'split': 'arc', 'accuracy': 0.5, 'accuracy_norm': 0.6})
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  out = tmp_path / 'curves.png'  # the command: its absl flags clash with other tools' in-process
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'plot', str(tmp_path), f'--out={out}'],
                        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 0, proc.stderr
  # loss, accuracy, accuracy_norm and mixture: four panels of 5.5 inches at 100 dpi.
  assert image.imread(out).shape[1] == 4 * 550

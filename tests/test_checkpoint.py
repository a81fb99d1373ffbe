"""Checkpoints resume exactly, reshard onto other meshes, survive torn/corrupt saves and NaNs."""

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain.data.records import ID
from disttrain.errors import CheckpointError
from disttrain.operating import events, metrics
from disttrain.storage import checkpoint, checkpoint_reads
from tests.conftest import ROOT, subprocess_env
from tests import helpers
from tests.helpers import devices, make_config, metrics_records, tensorboard_scalars, to_numpy

LAUNCH = [sys.executable, str(ROOT / 'launch' / 'train.py'),
          f'--config={ROOT / "launch" / "configs" / "mnist_mlp.py"}', '--fake_devices=8',
          '--config.model.hidden=128', '--config.global_batch_size=64',
          '--config.log_every_steps=1', '--config.checkpoint_every_steps=20']
STEPS = 90
# The runs that are interrupted ask for more steps than STEPS (the learning rate is constant, so
# the count changes nothing they train): they cannot finish before the signal reaches them, and a
# stop saved up to 45 steps after the signal still resumes below STEPS. Evals at 30 (before the
# checkpoint the relaunch resumes from), 60 and 90 (after it).
EVALS = '--config.eval_every_steps=30'


def _env():
  return subprocess_env()


def _launch(workdir, *extra, steps: int = STEPS) -> subprocess.Popen:
  command = LAUNCH + [f'--workdir={workdir}', f'--config.num_train_steps={steps}', *extra]
  return subprocess.Popen(helpers.foreground(command), env=_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _train_losses(workdir) -> dict[int, float]:
  """step -> loss of the train records (each step once: a resumed run moves the ones it trains
  again to metrics.superseded.jsonl)."""
  losses = {}
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    for line in f:
      record = json.loads(line)
      if record['split'] == 'train':
        losses[record['step']] = record['loss']
  return losses


def _last_logged_step(workdir) -> int:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return 0
  steps = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        steps.append(json.loads(line)['step'])
      except json.JSONDecodeError:  # the line being written right now
        break
  return max(steps, default=0)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('uninterrupted')
  proc = _launch(workdir, EVALS)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out
  return workdir


@pytest.mark.slow
# Ctrl-C (SIGINT) sets the same agreed stop as SIGTERM in one process (parallel/distributed.py);
# its exit 130 and bitwise resume: test_multiprocess.py::test_sigterm_then_ctrl_c_save_on_every_
# process_and_resume_exactly.
@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_bit_exactly(sig, uninterrupted, tmp_path):
  proc = _launch(tmp_path, EVALS, steps=1000)
  # Kill at a step after the second checkpoint (steps 20 and 40) has committed.
  while (_last_logged_step(tmp_path) < 45 or not (tmp_path / 'checkpoints' / '40').is_dir()) \
      and proc.poll() is None:
    time.sleep(0.02)
  assert proc.poll() is None, 'the run finished before it could be interrupted'
  logged_at_signal = _last_logged_step(tmp_path)
  proc.send_signal(sig)
  out, _ = proc.communicate(timeout=120)
  if sig == signal.SIGTERM:
    assert proc.returncode == disttrain.Preempted.exit_code, out
    assert 'preempted: saved a checkpoint at step' in out
  elif sig == signal.SIGINT:  # Ctrl-C: the same agreed stop and save, exit 130, no traceback
    assert proc.returncode == disttrain.Interrupted.exit_code == 130, out
    assert 'interrupted: saved a checkpoint at step' in out and 'Traceback' not in out, out
  else:
    assert proc.returncode == -signal.SIGKILL
  saved = sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())
  resume_step = saved[-1]
  assert resume_step >= 40
  if sig != signal.SIGKILL:
    # Preemption saves at the step where it stopped (a multiple of 20 only by chance), which is
    # no earlier than the last step logged before the signal.
    stopped = int(re.search(r'saved a checkpoint at step (\d+)', out).group(1))
    assert resume_step == stopped >= logged_at_signal, (resume_step, stopped, logged_at_signal)

  relaunch = _launch(tmp_path, EVALS)
  out, _ = relaunch.communicate(timeout=300)
  assert relaunch.returncode == 0, out
  assert f'resumed from step {resume_step}' in out
  expected, actual = _train_losses(uninterrupted), _train_losses(tmp_path)
  after = [s for s in range(resume_step + 1, STEPS + 1)]
  assert [actual[s] for s in after] == [expected[s] for s in after]  # bitwise equal
  for a, b in zip(helpers.saved_params(tmp_path, STEPS),
                  helpers.saved_params(uninterrupted, STEPS)):
    np.testing.assert_array_equal(a, b)
  _assert_clean_curves(tmp_path, uninterrupted, resume_step, killed=sig == signal.SIGKILL)


def _assert_clean_curves(workdir, uninterrupted, resume_step: int, killed: bool) -> None:
  """metrics.jsonl as it is and TensorBoard's reader show each step once, equal to the
  uninterrupted run's curve; what a killed attempt logged past its checkpoint is kept aside."""
  for split, tag in (('train', 'train/loss'), ('eval', 'eval/loss')):
    records, reference = metrics_records(workdir, split), metrics_records(uninterrupted, split)
    assert [r['step'] for r in records] == [r['step'] for r in reference]  # once each, in order
    assert [r['loss'] for r in records] == [r['loss'] for r in reference]  # bitwise
    assert tensorboard_scalars(workdir, tag) == tensorboard_scalars(uninterrupted, tag)
  superseded = workdir / 'metrics.superseded.jsonl'
  assert superseded.exists() == killed  # a saved stop leaves nothing to supersede
  if killed:  # the steps logged after the checkpoint, trained again by the resumed run
    steps = [json.loads(line)['step'] for line in superseded.read_text().splitlines()]
    assert steps and min(steps) > resume_step, (steps, resume_step)


def _layout(cfg, n):
  run = disttrain.setup(cfg, devices=devices(n))
  return checkpoint.abstract_like(run.layout.shardings, run.state), run.layout


@pytest.fixture(scope='module')
def saved_on_eight(tmp_path_factory):
  """A data=8 checkpoint at step 10, and the uninterrupted data=8 losses for steps 1-12."""
  common = dict(log_every_steps=1, model__dropout=0.0, model__hidden=128)
  reference = disttrain.train(make_config(mesh__data=8, num_train_steps=12, **common),
                              str(tmp_path_factory.mktemp('ref')), devices=devices(8))
  workdir = tmp_path_factory.mktemp('saved8')
  saved = disttrain.train(make_config(mesh__data=8, num_train_steps=10, **common), str(workdir),
                          devices=devices(8))
  losses = {r['step']: r['loss'] for r in reference.records if r['split'] == 'train'}
  return workdir, to_numpy(saved.state.params), losses, common


@pytest.mark.parametrize('mesh_overrides,n', [
    pytest.param({'mesh__data': 1}, 1, marks=pytest.mark.slow),
    ({'mesh__data': 4, 'mesh__tensor': 2}, 8)])
def test_checkpoint_restores_onto_another_mesh(saved_on_eight, mesh_overrides, n, tmp_path):
  source, saved_params, losses, common = saved_on_eight
  cfg = make_config(num_train_steps=12, **mesh_overrides, **common)
  abstract, lay = _layout(cfg, n)
  restored = checkpoint.Checkpointer(str(source), cfg).restore_latest(abstract)
  state, _, meta, step = restored
  assert step == 10 and meta['mesh']['data'] == 8
  for got, want in zip(jax.tree.leaves(to_numpy(state.params)), jax.tree.leaves(saved_params)):
    np.testing.assert_array_equal(got, want)  # exactly the saved values
  assert state.params['Dense_0']['kernel'].sharding == lay.shardings.params['Dense_0']['kernel']
  # Training continues on the new mesh; its next steps match the uninterrupted 8-device run.
  workdir = tmp_path / 'continue'
  shutil.copytree(source, workdir)
  result = disttrain.train(cfg, str(workdir), devices=devices(n))
  resumed = {r['step']: r['loss'] for r in result.records if r['split'] == 'train'}
  assert sorted(resumed) == [11, 12]
  np.testing.assert_allclose([resumed[11], resumed[12]], [losses[11], losses[12]], rtol=1e-4)


def _copy_run(source, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(source, workdir)
  return workdir


def test_torn_save_is_ignored_and_cleaned(saved_on_eight, tmp_path):
  source, _, _, common = saved_on_eight
  workdir = _copy_run(source, tmp_path)
  ckpt_dir = workdir / 'checkpoints'
  # What a kill during an async save leaves: orbax's temporary directory, never committed.
  torn = ckpt_dir / '11.orbax-checkpoint-tmp'
  shutil.copytree(ckpt_dir / '10', torn)
  os.remove(next(iter(glob.glob(str(torn / 'state' / 'ocdbt.process_0' / 'd' / '*')))))
  cfg = make_config(mesh__data=8, num_train_steps=12, **common)
  abstract, _ = _layout(cfg, 8)
  manager = checkpoint.Checkpointer(str(workdir), cfg)
  assert manager.steps() == [10]
  assert manager.restore_latest(abstract)[3] == 10
  manager.close()  # the clean-up of temporary directories runs in the background
  assert not torn.exists(), 'the torn temporary directory should be cleaned up'


def test_corrupt_latest_falls_back_to_previous(saved_on_eight, tmp_path, capsys):
  source, saved_params, _, common = saved_on_eight
  workdir = _copy_run(source, tmp_path)
  ckpt_dir = workdir / 'checkpoints'
  # A second complete checkpoint at step 12, then its array data truncated.
  cfg = make_config(mesh__data=8, num_train_steps=12, checkpoint_every_steps=12, **common)
  disttrain.train(cfg, str(workdir), devices=devices(8))
  assert sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) == [10, 12]
  for path in glob.glob(str(ckpt_dir / '12' / 'state' / '**' / 'd' / '*'), recursive=True):
    with open(path, 'r+b') as f:
      f.truncate(max(os.path.getsize(path) // 3, 1))
  abstract, _ = _layout(cfg, 8)
  state, _, _, step = checkpoint.Checkpointer(str(workdir), cfg).restore_latest(abstract)
  out = capsys.readouterr().out
  assert step == 10
  assert 'checkpoint step 12 is corrupt' in out and 'resuming from step 10' in out
  for got, want in zip(jax.tree.leaves(to_numpy(state.params)), jax.tree.leaves(saved_params)):
    np.testing.assert_array_equal(got, want)
  assert (ckpt_dir / '10').is_dir(), 'the complete checkpoint must survive'
  assert len(os.listdir(ckpt_dir / 'corrupt')) == 1, 'the corrupt one is kept aside, not deleted'


def test_checkpoint_of_another_model_names_first_mismatch(saved_on_eight, tmp_path):
  source, _, _, common = saved_on_eight
  workdir = _copy_run(source, tmp_path)
  cfg = make_config(mesh__data=8, num_train_steps=12, **{**common, 'model__hidden': 64})
  with pytest.raises(CheckpointError, match=r'params/BatchNorm_0/bias has shape \(128,\) but the '
                                            r'config expects \(64,\)') as err:
    disttrain.train(cfg, str(workdir), devices=devices(8))
  assert '\n' not in str(err.value)
  assert (workdir / 'checkpoints' / '10').is_dir()
  # The same model with a clipped gradient: the optimizer state differs, named as such.
  cfg = make_config(mesh__data=8, num_train_steps=12, **{**common, 'grad_clip_norm': 1.0})
  with pytest.raises(CheckpointError, match=r'has no opt_state/.* it was saved for another '
                                            r'optimizer \(optimizer, grad_clip_norm'):
    disttrain.train(cfg, str(workdir), devices=devices(8))


def test_a_warm_start_reads_the_params_for_any_optimizer_and_names_a_damaged_step(
    saved_on_eight, tmp_path):
  """restore_from: the optimizer starts fresh, so another one's state is no mismatch (sgd with
  clipping was refused: 'has no opt_state/...'); a damaged step is one line (a traceback)."""
  source, saved_params, _, common = saved_on_eight
  cfg = make_config(mesh__data=4, mesh__tensor=2, num_train_steps=12, optimizer='sgd',
                    grad_clip_norm=1.0, **common)
  abstract, lay = _layout(cfg, 8)
  params, _, step = checkpoint_reads.restore_params(str(source / 'checkpoints'), abstract)
  assert step == 10
  for got, want in zip(jax.tree.leaves(to_numpy(params)), jax.tree.leaves(saved_params)):
    np.testing.assert_array_equal(got, want)
  assert params['Dense_0']['kernel'].sharding == lay.shardings.params['Dense_0']['kernel']
  workdir = _copy_run(source, tmp_path)
  for path in glob.glob(str(workdir / 'checkpoints' / '10' / 'state' / '**' / 'd' / '*'),
                        recursive=True):
    with open(path, 'r+b') as f:
      f.truncate(max(os.path.getsize(path) // 3, 1))
  with pytest.raises(CheckpointError, match=r"restore_from=.*: step 10 cannot be read \(") as e:
    checkpoint_reads.restore_params(str(workdir / 'checkpoints'), abstract)
  assert '\n' not in str(e.value)
  # Another model's checkpoint: the fix is another restore_from (it said 'another workdir').
  wider, _ = _layout(make_config(mesh__data=8, **{**common, 'model__hidden': 256}), 8)
  with pytest.raises(CheckpointError, match=r'params/BatchNorm_0/bias has shape \(128,\) but the '
                                            r'config expects \(256,\); use another restore_from$'):
    checkpoint_reads.restore_params(str(source / 'checkpoints'), wider)
  (tmp_path / 'a_file').write_text('')  # said 'does not exist'
  with pytest.raises(CheckpointError, match=r"restore_from='.*a_file' is a file; pass a check"):
    checkpoint_reads.restore_params(str(tmp_path / 'a_file'), abstract)


def test_record_lines_a_resume_cannot_read_are_moved_aside_byte_for_byte(tmp_path):
  """metrics.jsonl lines of bad UTF-8 or with a step that is no number were a UnicodeDecodeError or
  TypeError traceback at a relaunch; they go to metrics.superseded.jsonl as they are, like a line
  cut short by a kill. events.jsonl's are skipped."""
  path = tmp_path / 'metrics.jsonl'
  good = [(json.dumps({'step': s, 'split': 'train', 'loss': 1.0}) + '\n').encode()
          for s in (1, 2, 3)]
  bad = [b'\xff\xfe\n', b'{"step": null, "split": "train"}\n', b'[1]\n']
  path.write_bytes(good[0] + bad[0] + good[1] + bad[1] + bad[2] + good[2])
  assert metrics.supersede(str(path), 2) == ([3], {(2, 'train')})
  assert path.read_bytes() == good[0] + good[1]
  assert (tmp_path / 'metrics.superseded.jsonl').read_bytes() == b''.join(bad) + good[2]
  (tmp_path / 'events.jsonl').write_bytes(b'{"event": "start"}\n\xff\n{"event": "end"}\n')
  assert [e['event'] for e in events.read(str(tmp_path))] == ['start', 'end']


def test_nan_stops_with_step_and_keeps_last_finite_checkpoint(tmp_path):
  # SGD at lr 1e4 diverges within a few steps (measured: NaN at step 4 on digits).
  proc = subprocess.run(
      LAUNCH + [f'--workdir={tmp_path}', '--config.num_train_steps=60',
                '--config.checkpoint_every_steps=1', '--config.optimizer=sgd',
                '--config.learning_rate=1e4', '--config.model.dropout=0'],
      env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  error = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(error) == 1 and 'NonFiniteError: step ' in error[0], proc.stderr
  bad_step = int(error[0].split('step ')[1].split(':')[0])
  saved = sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())
  assert saved[-1] == bad_step - 1
  finite = [r for r in map(json.loads, open(tmp_path / 'metrics.jsonl')) if r['split'] == 'train']
  assert all(np.isfinite(r['loss']) for r in finite)


class _IdTask(disttrain.Classification):
  """Classification plus per-step fingerprints of the example ids in the global batch."""

  def per_example(self, logits, batch):
    out = super().per_example(logits, batch)
    ids = batch[ID].astype(jnp.float32)
    return {**out, 'id_mean': ids, 'id_sq_mean': ids * ids}


def test_data_order_after_resume_equals_uninterrupted(tmp_path):
  common = dict(mesh__data=8, log_every_steps=1, model__hidden=32)
  full = disttrain.train(make_config(num_train_steps=30, **common), str(tmp_path / 'full'),
                         task=_IdTask(), devices=devices(8))
  disttrain.train(make_config(num_train_steps=13, **common), str(tmp_path / 'split'),
                  task=_IdTask(), devices=devices(8))
  resumed = disttrain.train(make_config(num_train_steps=30, **common), str(tmp_path / 'split'),
                            task=_IdTask(), devices=devices(8))
  def fingerprints(result):
    return {r['step']: (r['id_mean'], r['id_sq_mean']) for r in result.records
            if r['split'] == 'train'}
  expected, actual = fingerprints(full), fingerprints(resumed)
  assert sorted(actual) == list(range(14, 31))  # 1500 examples / 64 = 23 steps an epoch: crosses
  assert all(actual[s] == expected[s] for s in actual)
  assert len(set(expected.values())) == 30  # every step saw a different batch


def test_no_restorable_checkpoint_moves_nothing(saved_on_eight, tmp_path):
  source, _, _, common = saved_on_eight
  workdir = _copy_run(source, tmp_path)
  ckpt_dir = workdir / 'checkpoints'
  for path in glob.glob(str(ckpt_dir / '10' / 'state' / '**' / 'd' / '*'), recursive=True):
    with open(path, 'r+b') as f:
      f.truncate(max(os.path.getsize(path) // 3, 1))
  cfg = make_config(mesh__data=8, num_train_steps=12, **common)
  abstract, _ = _layout(cfg, 8)
  # Nothing restores (as under an out-of-memory error): nothing may be moved, or a relaunch
  # would silently start from step 0.
  with pytest.raises(CheckpointError, match='left in place'):
    checkpoint.Checkpointer(str(workdir), cfg).restore_latest(abstract)
  assert (ckpt_dir / '10').is_dir() and not (ckpt_dir / 'corrupt').exists()


@pytest.mark.slow
def test_a_relaunch_ranking_by_a_new_eval_sources_metric_keeps_saving(tmp_path):
  """best_metric='val/accuracy' once a named eval source is added: the older steps' stored metrics
  lack it, and orbax's ranking raised KeyError at every save (each relaunch kept one more step).
  They rank last now: the newest and the best of the new metric are kept."""
  from tests.test_user_data import MODEL, TASK, _breast_cancer, _config  # pylint: disable=g-import-not-at-top
  train, held = _breast_cancer()
  run = lambda steps, eval_data, best: disttrain.train(
      _config(1, num_train_steps=steps, eval_every_steps=2, checkpoint_every_steps=2,
              max_to_keep=1, best_metric=best), str(tmp_path), model=MODEL, task=TASK,
      devices=devices(1), train_data=train, eval_data=eval_data)
  run(4, held, 'accuracy')
  halves = {'val': {k: v[:40] for k, v in held.items()}, 'test': {k: v[40:] for k, v in held.items()}}
  assert run(8, halves, 'val/accuracy').step == 8
  accuracy = {r['step']: r['accuracy'] for r in metrics_records(tmp_path, 'val')}
  best = max(sorted(accuracy), key=accuracy.get)  # the first of equal ones, as orbax keeps
  kept = sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())
  assert kept == sorted({best, 8}), (kept, accuracy)


def test_a_save_out_of_space_names_its_step_and_a_damaged_step_names_an_older_one(tmp_path,
                                                                                   monkeypatch):
  """max_to_keep=1 deleted steps 2 and 4 on purpose, and a full disk at step 8's save was reported
  as step 2's. A damaged newest step's metadata was a JSONDecodeError traceback from export,
  generate, compare and lm-eval (training falls back to an older step)."""
  import errno  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  real, calls = ocp.StandardCheckpointHandler.async_save, []

  def full_at_the_fourth_save(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 4:
      raise OSError(errno.ENOSPC, 'No space left on device')
    return real(self, *args, **kwargs)
  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'async_save', full_at_the_fourth_save)
  cfg = make_config(num_train_steps=10, checkpoint_every_steps=2, max_to_keep=1, log_every_steps=2)
  with pytest.raises(CheckpointError, match=r'saving checkpoint step 8 to \S+ failed: no space '
                                            r'left on device; the last complete checkpoint is '
                                            r'step 6, kept'):
    disttrain.train(cfg, str(tmp_path / 'full'), devices=devices(1))
  monkeypatch.undo()
  disttrain.train(dataclasses.replace(cfg, num_train_steps=4, max_to_keep=3), str(tmp_path / 'run'),
                  devices=devices(1))
  (tmp_path / 'run' / 'checkpoints' / '4' / 'meta' / 'metadata').write_text('{')
  with pytest.raises(CheckpointError, match=r'checkpoints/4 cannot be read \(JSONDecodeError: .*\); '
                                            r'pass --step=2 \(an older one\)'):
    checkpoint_reads.run_config(str(tmp_path / 'run'))


def test_best_checkpoint_is_kept_beside_the_latest_across_a_relaunch_and_a_preemption(tmp_path):
  """max_to_keep=1 with best_metric: the best evaluated checkpoint stays beside the latest after
  a relaunch (its metrics read back from disk; orbax wrote none without best_fn, and the first
  save after a relaunch dropped the best), and when the latest is a SIGTERM save between evals
  (saved without metrics: ranked by the last eval's, an older state's, it tied the evaluated
  checkpoint and orbax dropped that one)."""
  # best_mode='max' on the eval loss keeps the *worst* loss: step 5, since the loss falls.
  common = dict(mesh__data=8, eval_every_steps=5, checkpoint_every_steps=5, max_to_keep=1,
                best_metric='loss', model__hidden=32, log_every_steps=5)
  for steps in (10, 20):
    disttrain.train(make_config(num_train_steps=steps, best_mode='max', **common),
                    str(tmp_path / 'relaunched'), devices=devices(8))
  losses = {r['step']: r['loss'] for r in metrics_records(tmp_path / 'relaunched', 'eval')}
  assert max(losses, key=losses.get) == 5 and sorted(losses) == [5, 10, 15, 20]
  kept = sorted(int(d) for d in os.listdir(tmp_path / 'relaunched' / 'checkpoints') if d.isdigit())
  assert kept == [5, 20]

  class Preempt(disttrain.Callback):
    def on_train_record(self, record):
      if record['step'] == 11:
        os.kill(os.getpid(), signal.SIGTERM)
  cfg = make_config(num_train_steps=20, best_mode='min', **{**common, 'log_every_steps': 1})
  with pytest.raises(disttrain.Preempted) as stopped:
    disttrain.train(cfg, str(tmp_path / 'preempted'), devices=devices(8), callbacks=[Preempt()])
  at = int(re.search(r'at step (\d+)', str(stopped.value)).group(1))
  losses = {r['step']: r['loss'] for r in metrics_records(tmp_path / 'preempted', 'eval')}
  assert sorted(losses) == [5, 10] and 10 < at < 15
  saved = tmp_path / 'preempted' / 'checkpoints'
  assert sorted(int(d) for d in os.listdir(saved) if d.isdigit()) == [
      min(losses, key=losses.get), at]
  assert (saved / '10' / 'metrics').exists() and not (saved / str(at) / 'metrics').exists()


def test_best_metric_needs_checkpoints_at_eval_steps_and_a_metric_of_the_eval(tmp_path):
  with pytest.raises(disttrain.ConfigError, match='must be a positive multiple of '
                                                  'eval_every_steps=300'):
    make_config(best_metric='accuracy', eval_every_steps=300, checkpoint_every_steps=100)
  # A name the eval does not give: a KeyError traceback inside orbax at the second save.
  cfg = make_config(best_metric='eval/acc', eval_every_steps=2, checkpoint_every_steps=2,
                    num_train_steps=4, model__hidden=16)
  with pytest.raises(disttrain.ConfigError, match=re.escape(
      "best_metric='eval/acc' is not a metric of the eval, which gives ['eval/accuracy', "
      "'eval/loss']; use one of them")):
    disttrain.train(cfg, str(tmp_path), devices=devices(1))


ACCUMULATED_BF16 = ('--config.grad_accum_steps=2', '--config.precision.compute_dtype=bfloat16')


@pytest.mark.slow
def test_accumulated_bf16_run_resumes_bit_exactly_and_restores_without_accumulation(tmp_path):
  """grad_accum_steps=2 in bf16: SIGKILL after the step-40 checkpoint, relaunch: steps 41-60
  and the final params are bitwise those of an uninterrupted run. The micro-batch count is not
  part of the state: the same checkpoints then continue with grad_accum_steps=1."""
  steps = ('--config.num_train_steps=60',)
  full = _launch(tmp_path / 'full', *ACCUMULATED_BF16, *steps)
  out, _ = full.communicate(timeout=300)
  assert full.returncode == 0, out
  proc = _launch(tmp_path / 'run', *ACCUMULATED_BF16, '--config.num_train_steps=1000')
  while not (tmp_path / 'run' / 'checkpoints' / '40').is_dir() and proc.poll() is None:
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=120)
  saved = sorted(int(d) for d in os.listdir(tmp_path / 'run' / 'checkpoints') if d.isdigit())
  relaunch = _launch(tmp_path / 'run', *ACCUMULATED_BF16, *steps)
  out, _ = relaunch.communicate(timeout=300)
  assert relaunch.returncode == 0 and f'resumed from step {saved[-1]}' in out, out
  expected, actual = _train_losses(tmp_path / 'full'), _train_losses(tmp_path / 'run')
  after = range(saved[-1] + 1, 61)
  assert [actual[s] for s in after] == [expected[s] for s in after]  # bitwise
  for a, b in zip(helpers.saved_params(tmp_path / 'run', 60),
                  helpers.saved_params(tmp_path / 'full', 60)):
    np.testing.assert_array_equal(a, b)
  one = _launch(tmp_path / 'run', '--config.precision.compute_dtype=bfloat16',
                '--config.grad_accum_steps=1', '--config.num_train_steps=70')
  out, _ = one.communicate(timeout=300)
  assert one.returncode == 0 and 'resumed from step 60' in out, out
  assert all(np.isfinite(_train_losses(tmp_path / 'run')[s]) for s in range(61, 71))


@pytest.fixture
def small_disk(tmp_path):
  """A 14 MiB filesystem (a tmpfs: mounting needs root, which CI has)."""
  mount = tmp_path / 'disk'
  mount.mkdir()
  if os.geteuid() != 0:
    pytest.skip('mounting a 14 MiB tmpfs needs root (CI runs as root)')
  subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=14m', 'tmpfs', str(mount)], check=True)
  yield mount
  subprocess.run(['umount', '-l', str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(small_disk, tmp_path):
  """Checkpoints of ~3.4 MiB every 5 steps on 14 MiB: four fit, the fifth (step 25) is refused
  before orbax starts it, with one line naming the step, the directory, the space and the last
  complete checkpoint; exit 2; steps 5-20 kept, and step 20 resumes once there is room."""
  flags = [sys.executable, str(ROOT / 'launch' / 'train.py'),
           f'--config={ROOT / "launch" / "configs" / "mnist_mlp.py"}', '--fake_devices=2',
           '--config.checkpoint_every_steps=5', '--config.max_to_keep=5',
           '--config.log_every_steps=1']  # one compiled step (every 25 adds a quiet one)
  proc = subprocess.run([*flags, f'--workdir={small_disk / "run"}', '--config.num_train_steps=30'],
                        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300,
                        check=False)
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith(f'error: CheckpointError: saving checkpoint step 25 to '
                              f'{small_disk}/run/checkpoints needs about '), errors[0]
  assert 'the last complete checkpoint is step 20, kept' in errors[0], errors[0]
  assert sorted(int(d) for d in os.listdir(small_disk / 'run' / 'checkpoints') if d.isdigit()) \
      == [5, 10, 15, 20]
  shutil.copytree(small_disk / 'run', tmp_path / 'roomy')
  again = subprocess.run([*flags, f'--workdir={tmp_path / "roomy"}', '--config.num_train_steps=25'],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
  assert again.returncode == 0 and 'resumed from step 20' in again.stdout, again.stderr[-2000:]


def test_small_replicated_arrays_are_saved_whole_and_large_ones_in_slices(tmp_path, caplog):
  """orbax writes a replicated array as one slice per replica and compiles a slice program per
  (shape, device) first: an 8-device save of small arrays compiles none (one replica writes them
  whole), while an array whose per-replica slice reaches MIN_REPLICA_SLICE_BYTES is still split
  (on an orbax without the threshold both are split, its default). Both restore to what was
  saved."""
  replicated = jax.sharding.NamedSharding(jax.make_mesh((8,), ('data',), devices=devices(8)),
                                          jax.sharding.PartitionSpec())
  rows = 8 * checkpoint.MIN_REPLICA_SLICE_BYTES // (4 * 256)  # 8 slices of the threshold's size
  trees = {'small': {'w': np.arange(64 * 96, dtype=np.float32).reshape(64, 96)},
           'large': {'w': np.arange(rows * 256, dtype=np.float32).reshape(rows, 256)}}
  for name, tree in trees.items():
    state = jax.device_put(tree, replicated)
    ckpt = checkpoint.Checkpointer(str(tmp_path / name), make_config())
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level('WARNING'):
      ckpt.save(1, state, {}, {})
      ckpt.wait()
    slices = [r for r in caplog.records if 'Compiling jit(slice)' in r.getMessage()]
    whole = name == 'small' and checkpoint.HAS_SLICE_THRESHOLD
    assert len(slices) == (0 if whole else 8), (name, len(slices))
    restored = ckpt.restore_latest(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree))
    np.testing.assert_array_equal(np.asarray(restored[0]['w']), tree['w'])
    ckpt.close()


def test_a_finished_run_relaunched_writes_its_last_eval_once(tmp_path, monkeypatch):
  """The relaunch evaluates the last step again (its Result has the eval); metrics.jsonl and
  TensorBoard held that step's eval twice. tensorboardX names its event file by the second: a
  relaunch within the same second (frozen here, as in a CI run) truncated the first run's."""
  from tensorboardX import event_file_writer  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(event_file_writer, 'time', types.SimpleNamespace(time=lambda: 1764450000.5))
  cfg = make_config(num_train_steps=10, log_every_steps=5, eval_every_steps=5)
  disttrain.train(cfg, str(tmp_path), devices=devices(1))
  again = disttrain.train(cfg, str(tmp_path), devices=devices(1))
  assert [r['step'] for r in again.records if r['split'] == 'eval'] == [10]
  assert [r['step'] for r in metrics_records(tmp_path, 'eval')] == [5, 10]
  assert sorted(tensorboard_scalars(tmp_path, 'eval/loss')) == [5, 10]


def test_a_resume_between_records_writes_the_uninterrupted_runs_records(tmp_path):
  """SIGTERM at step 3 of log_every_steps=4: the resumed run's record at step 4 averaged step 4
  alone (1.36 against 2.02 in a review); the steps since the last record now travel in the
  checkpoint."""
  fields = dict(num_train_steps=8, log_every_steps=4, eval_every_steps=3)
  straight = disttrain.train(make_config(**fields), str(tmp_path / 'a'), devices=devices(1))

  class Preempt(disttrain.Callback):
    def on_eval(self, record):
      if record['step'] == 3:
        os.kill(os.getpid(), signal.SIGTERM)
  with pytest.raises(disttrain.Preempted):
    disttrain.train(make_config(**fields), str(tmp_path / 'b'), devices=devices(1),
                    callbacks=[Preempt()])
  resumed = disttrain.train(make_config(**fields), str(tmp_path / 'b'), devices=devices(1))
  train = lambda result: {r['step']: r['loss'] for r in result.records if r['split'] == 'train'}
  assert train(resumed) == train(straight), (train(resumed), train(straight))

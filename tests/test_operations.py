"""Operating a run: callbacks and early stopping, custom eval metrics, profiler windows, where
the time went, plots, Ctrl-C and the watchdog on one process (test_multiprocess.py has the
multi-process side: agreed stops, Ctrl-C on a cluster, a hung process named)."""

import json
import os
import runpy
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain.data import sources
from disttrain.errors import ConfigError
from disttrain.parallel import distributed
from tests.conftest import ROOT, subprocess_env
from tests.helpers import devices, make_config, to_numpy

OPS = 'tests/configs/ops.py'


def _mlp(**overrides):
  """The seed-004 MLP without BatchNorm (jax_mlp): with learning_rate=0 nothing changes at all."""
  fields = dict(mesh__data=8, model__name='jax_mlp', model__hidden=32, log_every_steps=5,
                eval_every_steps=5, checkpoint_every_steps=5, num_train_steps=100)
  return make_config(**{**fields, **overrides})


def _env(**extra) -> dict:
  return subprocess_env(**extra)


def _launch(workdir, *flags, env=None, timeout=180):
  return subprocess.run([sys.executable, 'launch/train.py', f'--config={OPS}',
                         f'--workdir={workdir}', '--fake_devices=8', '--config.model.hidden=32',
                         *flags], cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                        timeout=timeout, check=False)


# ------------------------------------------------------------------------------------------
# Early stopping and callbacks.

def test_early_stopping_stops_a_plateau_after_patience_evals(tmp_path):
  early = disttrain.EarlyStopping('eval/accuracy', patience=2)
  result = disttrain.train(_mlp(learning_rate=0.0), str(tmp_path), devices=devices(8),
                           callbacks=[early])
  # Evals at 5 (the best), 10 and 15 (no improvement): the run stops at 15, saved there.
  assert result.step == 15 and 'EarlyStopping' in result.stopped_by, result.stopped_by
  assert early.state() == {'best': early.best, 'best_step': 5, 'since_best': 2}
  assert sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())[-1] == 15
  assert all(isinstance(v, (int, float, str)) for r in result.records for v in r.values())
  # Relaunched (a restarted job), it trains no step more: it went on to 20 and saved there.
  again = disttrain.train(_mlp(learning_rate=0.0), str(tmp_path), devices=devices(8),
                          callbacks=[disttrain.EarlyStopping('eval/accuracy', patience=2)])
  assert again.step == 15 and 'EarlyStopping' in again.stopped_by and not again.records
  assert sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())[-1] == 15


@pytest.mark.slow
def test_early_stopping_from_config_fields_never_stops_an_improving_run(tmp_path):
  result = disttrain.train(_mlp(learning_rate=3e-3, num_train_steps=30,
                                early_stop__metric='eval/loss', early_stop__mode='min',
                                early_stop__patience=2), str(tmp_path), devices=devices(8))
  evals = [r['loss'] for r in result.records if r['split'] == 'eval']
  assert result.step == 30 and not result.stopped_by and len(evals) == 6
  assert evals == sorted(evals, reverse=True)  # it improved at every eval


def test_early_stopping_state_is_checkpointed_so_a_resumed_run_stops_at_the_same_step(tmp_path):
  """Uninterrupted: stops at 15 (above). Stopped at 10 (a checkpoint, evals at 5 and 10) and
  resumed: still 15, because the count of evals since the best came back with the checkpoint
  (a fresh count would stop at 25)."""
  cfg = lambda steps: _mlp(learning_rate=0.0, num_train_steps=steps,
                           early_stop__metric='eval/accuracy', early_stop__patience=2)
  csv_log = lambda: [disttrain.CsvLogger(str(tmp_path / 'log.csv'))]
  first = disttrain.train(cfg(10), str(tmp_path), devices=devices(8), callbacks=csv_log())
  assert first.step == 10 and not first.stopped_by
  resumed = disttrain.train(cfg(100), str(tmp_path), devices=devices(8), callbacks=csv_log())
  assert resumed.step == 15 and 'EarlyStopping' in resumed.stopped_by
  # The CSV keeps the first run's rows (it was rewritten from the resumed run's alone), and a
  # relaunch of the finished run, which evaluates step 15 again, keeps step 15's train row.
  finished = disttrain.train(cfg(15), str(tmp_path), devices=devices(8), callbacks=csv_log())
  assert finished.step == 15
  rows = (tmp_path / 'log.csv').read_text().splitlines()[1:]
  assert [r.split(',')[:2] for r in rows] == [
      [str(step), split] for step in (5, 10, 15) for split in ('train', 'eval')]


def test_early_stopping_counts_a_nan_eval_as_no_improvement():
  """A NaN first eval was the best for good: nothing compares greater, so the run stopped
  after `patience` evals however much the metric improved."""
  early = disttrain.EarlyStopping('eval/loss', mode='min', patience=2)
  evals = [float('nan'), 0.9, 0.5, 0.6, float('nan')]
  answers = [early.on_eval({'step': 100 * (i + 1), 'split': 'eval', 'loss': v})
             for i, v in enumerate(evals)]
  assert answers[:4] == [None] * 4, answers
  assert answers[4].reason.endswith('for 2 evals (best 0.5 at step 300)')
  nan_only = disttrain.EarlyStopping('eval/loss', mode='min', patience=1)
  assert 'no finite value' in nan_only.on_eval({'step': 1, 'split': 'eval', 'loss': np.nan}).reason


def test_peak_flops_match_whole_device_names():
  from disttrain.operating.metrics import peak_flops  # pylint: disable=g-import-not-at-top
  kinds = {'NVIDIA L40S': 362e12, 'NVIDIA L40': 181e12, 'NVIDIA L4': 121e12,
           'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA A100-SXM4-80GB': 312e12, 'TPU v5p': 459e12,
           'TPU v5 lite': 197e12, 'NVIDIA RTX A6000': None, 'NVIDIA GH200 480GB': 989e12,
           'NVIDIA H100 PCIe': 756e12}  # GH200 was no match; the PCIe card took the SXM's
  assert {k: peak_flops(k) for k in kinds} == kinds


class _Counter(disttrain.Callback):
  """Reads records only; counts the hooks it sees."""

  def __init__(self):
    self.calls = {'on_train_record': 0, 'on_eval': 0, 'on_checkpoint': 0, 'on_end': 0}

  def on_train_record(self, record):
    self.calls['on_train_record'] += 1

  def on_eval(self, record):
    self.calls['on_eval'] += 1

  def on_checkpoint(self, step, path):
    assert os.path.isdir(os.path.dirname(path))
    self.calls['on_checkpoint'] += 1

  def on_end(self, result):
    self.calls['on_end'] += 1


def test_callbacks_that_only_read_records_add_no_device_fetch(tmp_path, monkeypatch):
  fetched = []
  real = jax.device_get
  monkeypatch.setattr(jax, 'device_get', lambda tree: fetched.append(1) or real(tree))
  plain = disttrain.train(_mlp(num_train_steps=20), str(tmp_path / 'a'), devices=devices(8))
  without = len(fetched)
  counter = _Counter()
  hooked = disttrain.train(_mlp(num_train_steps=20), str(tmp_path / 'b'), devices=devices(8),
                           callbacks=[counter, disttrain.CsvLogger(str(tmp_path / 'log.csv'))])
  assert len(fetched) - without == without  # the same fetches, callbacks or not
  assert hooked.trace_count == plain.trace_count == 1
  assert counter.calls == {'on_train_record': 4, 'on_eval': 4, 'on_checkpoint': 4, 'on_end': 1}
  rows = (tmp_path / 'log.csv').read_text().splitlines()
  assert rows[0].startswith('step,split') and len(rows) == 1 + 8


@pytest.mark.slow
def test_a_callback_that_raises_is_one_line_and_keeps_the_checkpoint(tmp_path):
  proc = _launch(tmp_path, '--config.num_train_steps=20', '--config.checkpoint_every_steps=5',
                 '--config.eval_every_steps=10', env=_env(RAISE_IN='on_eval'))
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr
  assert errors[0] == ('error: CallbackError: callback Boom.on_eval raised RuntimeError: boom '
                       'with dict; fix the callback (the last checkpoint is kept)')
  assert 'Traceback' not in proc.stdout + proc.stderr
  # The eval at step 10 raised before that step's save: step 5 is the last checkpoint, intact.
  relaunch = _launch(tmp_path, '--config.num_train_steps=12')
  assert relaunch.returncode == 0 and 'resumed from step 5' in relaunch.stdout, relaunch.stderr


# ------------------------------------------------------------------------------------------
# A custom eval step: top-5 accuracy, exact over a padded last batch.

def test_custom_eval_step_top5_is_exact_over_a_padded_batch(tmp_path):
  def top5(ctx, state, batch):
    logits = ctx.outputs(state, batch)
    label = batch['label']
    rank = jnp.sum(logits > jnp.take_along_axis(logits, label[:, None], axis=-1), axis=-1)
    return {**ctx.eval_sums(state, batch), 'top5': ctx.masked_sum(rank < 5, batch)}
  cfg = _mlp(num_train_steps=10, eval_batch_size=64, learning_rate=3e-3)
  result = disttrain.train(cfg, str(tmp_path), devices=devices(8), eval_step=top5)
  final = result.records[-1]
  held_out = sources.build(cfg)['eval_data']  # 297 examples: the last batch has 41 real rows
  params = to_numpy(result.state.params)
  logits = np.asarray(disttrain.models.jax_mlp_apply(params, held_out['image']))
  in_top5 = np.argsort(-logits, axis=-1)[:, :5] == held_out['label'][:, None]
  assert final['num_examples'] == 297
  assert round(final['top5'] * 297) == in_top5.any(-1).sum()  # exactly the count
  assert final['top5'] == pytest.approx(in_top5.any(-1).mean(), abs=1e-7)
  assert final['top5'] >= final['accuracy']


# ------------------------------------------------------------------------------------------
# The profiler window and where the time went.

def test_profiler_window_writes_a_trace_with_the_step_scopes(tmp_path, capsys):
  disttrain.train(_mlp(num_train_steps=12, profile__start_step=5, profile__num_steps=3),
                  str(tmp_path), devices=devices(8))
  out = capsys.readouterr().out
  traces = list((tmp_path / 'plugins' / 'profile').glob('*/*.xplane.pb'))
  assert len(traces) == 1 and traces[0].stat().st_size > 0, traces
  assert f'profile: steps 5-7 traced into {traces[0].parent}' in out
  content = traces[0].read_bytes()
  for scope in (b'loss_and_grads', b'optimizer_update'):
    assert scope in content, scope


@pytest.mark.slow
def test_time_breakdown_adds_up_and_points_at_the_culprit(tmp_path, monkeypatch):
  """The phases plus 'other' are the wall time; a slow data source shows as data, saving every
  step shows as checkpoint."""
  hooks = runpy.run_path(str(ROOT / OPS))

  def breakdown(name, **overrides):
    cfg = _mlp(**{'num_train_steps': 24, 'log_every_steps': 8, 'eval_every_steps': 0,
                  'checkpoint_every_steps': 0, **overrides})
    result = disttrain.train(cfg, str(tmp_path / name), devices=devices(8),
                             **hooks['get_data'](cfg))
    time = result.time
    phases = {k: v['seconds'] for k, v in time.items() if k not in ('wall_seconds', 'other')}
    assert abs(sum(phases.values()) - time['wall_seconds']) <= 0.05 * time['wall_seconds'], time
    assert json.loads((tmp_path / name / 'run.json').read_text())['time'] == time
    return {k: v['fraction'] for k, v in time.items() if k != 'wall_seconds'}, result
  monkeypatch.setenv('SLOW_READS', '0.1')
  slow_data, result = breakdown('slow_data')
  assert max(slow_data, key=slow_data.get) == 'data' and slow_data['data'] > 0.3, slow_data
  assert all(r['data_wait_fraction'] > 0.5 for r in result.records if r['split'] == 'train')
  monkeypatch.setenv('SLOW_READS', '0')
  saving, _ = breakdown('saving', checkpoint_every_steps=1)
  training = {k: v for k, v in saving.items() if k not in ('setup', 'compile')}
  assert max(training, key=training.get) == 'checkpoint', saving


# ------------------------------------------------------------------------------------------
# Plots.

def test_plot_skips_lines_that_are_not_records_and_names_the_file_it_wrote(tmp_path):
  from disttrain.operating import plot  # pylint: disable=g-import-not-at-top
  pytest.importorskip('matplotlib')
  (tmp_path / 'metrics.jsonl').write_text('[1, 2]\n{"step": 1, "loss": 9}\n{"step": 1, "split": '
                                          '"train", "loss": 0.5}\n{"step": 2, "split"')
  assert plot.read(str(tmp_path)) == {'train': {'loss': [(1, 0.5)]}}  # a TypeError, a KeyError
  assert plot.plot([str(tmp_path)], str(tmp_path / 'curves'), ['loss']) == str(
      tmp_path / 'curves.png')  # savefig adds .png; it said it wrote 'curves'
  assert (tmp_path / 'curves.png').is_file()
  with pytest.raises(ConfigError, match=r'cannot read .*metrics.jsonl: NotADirectoryError'):
    plot.read(str(tmp_path / 'curves.png'))


@pytest.mark.slow
def test_plot_draws_the_curves_of_two_runs(tmp_path):
  pytest.importorskip('matplotlib')
  for name, lr in (('fast', 3e-3), ('slow', 1e-4)):
    disttrain.train(_mlp(num_train_steps=20, learning_rate=lr), str(tmp_path / name),
                    devices=devices(8))
  out = tmp_path / 'curves.png'
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'plot', str(tmp_path / 'fast'),
                         str(tmp_path / 'slow'), f'--out={out}'], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0 and f'wrote {out}' in proc.stdout, proc.stderr
  from matplotlib import image  # pylint: disable=g-import-not-at-top
  pixels = image.imread(out)[..., :3]
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  for colour in ('#1f77b4', '#ff7f0e'):  # matplotlib's first two line colours: one per run
    rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    assert np.sum(np.all(np.abs(pixels - rgb) < 0.05, axis=-1)) > 200, colour


# ------------------------------------------------------------------------------------------
# Ctrl-C and the watchdog on one process.

class _SignalAtTheEnd(disttrain.Callback):
  def on_eval(self, record):
    if record['step'] == 6:
      os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_during_the_last_steps_eval_ends_the_run_normally(tmp_path):
  """Every step trained and the last save follows anyway: it raised Preempted ('relaunch to
  resume'), with no on_end and no time in run.json, and a supervisor relaunched it."""
  result = disttrain.train(make_config(num_train_steps=6, log_every_steps=3, eval_every_steps=3,
                                       model__hidden=16), str(tmp_path), devices=devices(1),
                           callbacks=[_SignalAtTheEnd()])
  assert result.step == 6 and result.stopped_by == ''
  assert 'time' in json.loads((tmp_path / 'run.json').read_text())
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['6']


def test_second_ctrl_c_is_left_to_the_default_action():
  """The first Ctrl-C asks for a checkpointed stop; the handler then restores SIGINT's default
  action, so a second one ends the process at once (the kernel's doing: no traceback). Closing
  puts back whatever handler was there before."""
  before = lambda *_: None  # a foreground job's handler (Python's default_int_handler)
  outer = signal.signal(signal.SIGINT, before)
  try:
    signals = distributed.StopSignals()
    try:
      assert not signals.interrupted and not signals.reached(1)
      signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # what the first Ctrl-C runs
      assert signals.interrupted and signals.reached(2)
      assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
      signals.close()
    assert signal.getsignal(signal.SIGINT) is before
  finally:
    signal.signal(signal.SIGINT, outer)


def test_a_background_job_leaves_its_ignored_ctrl_c_ignored():
  """Started with SIGINT ignored (`cmd &` in a script, nohup, a CI runner), a run leaves it so: a
  Ctrl-C meant for the terminal does not stop it; SIGTERM still does, at the next step."""
  outer = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    signals = distributed.StopSignals()
    try:
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
      os.kill(os.getpid(), signal.SIGINT)
      assert not signals.interrupted and not signals.reached(1)
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.01)  # Python runs the handler between bytecodes
      assert signals.reached(2) and not signals.interrupted
    finally:
      signals.close()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, outer)


@pytest.mark.slow
def test_healthy_slow_steps_are_never_killed_by_the_watchdog(tmp_path):
  # 6 reads of 0.6 s each (3.6 s in all) under a 1 s watchdog: each is shorter than the limit.
  proc = _launch(tmp_path, '--config.num_train_steps=5', '--config.log_every_steps=1',
                 '--config.watchdog_seconds=1', env=_env(SLOW_READS='0.6'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not (tmp_path / 'hang').exists() and 'watchdog' not in proc.stderr


def test_a_hang_ignores_an_earlier_attempts_reports_and_names_the_loop_between_phases(
    tmp_path, monkeypatch, capfd):
  """A second hang in one workdir took the first's DIR/hang/process_1.txt at once and named
  its process; the loop's work between phases (agreeing on a stop) read as set-up."""
  from disttrain.operating import timing, watchdog  # pylint: disable=g-import-not-at-top
  phases = timing.Phases()
  with phases('setup'), phases('compile'):
    pass
  with phases('step'):
    pass
  phases.finished(5000)
  assert phases.current == 'loop'
  (tmp_path / 'hang').mkdir()
  stale = {'process': 1, 'pid': 1, 'host': 'old-host', 'last_step': 5, 'waiting_for': 'data',
           'silent_seconds': 700, 'fired_at': time.time() - 3600}
  (tmp_path / 'hang' / 'process_1.txt').write_text(json.dumps(stale) + '\n')
  monkeypatch.setattr(watchdog, '_GRACE', 0.5)
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  guard = watchdog.Watchdog(0, phases, str(tmp_path))
  mine = guard._status(700.0)  # pylint: disable=protected-access
  (tmp_path / 'hang' / 'process_0.txt').write_text(json.dumps(mine) + '\n')
  reports = guard._reports(2)  # pylint: disable=protected-access
  assert [r['process'] for r in reports] == [0]
  verdict = guard._verdict(reports, 2)  # pylint: disable=protected-access
  assert verdict.startswith('watchdog: process 0 on') and "the loop's own work" in verdict
  assert 'some processes wrote no report' in verdict
  # Process 0 waits in the step for process 1, hung in a C call holding the GIL (its watchdog
  # thread could not write): process 1 is named, not the one that waits (it named process 0).
  verdict = guard._verdict([{**mine, 'waiting_for': 'step'}], 2)  # pylint: disable=protected-access
  assert verdict.startswith('watchdog: process(es) [1] wrote no report'), verdict
  # A workdir that cannot take the report: the process still says why and exits (the thread
  # died with the write's error, leaving the hang silent).
  class Exited(Exception):
    pass
  def refuse(*args):
    raise OSError('bucket down')
  monkeypatch.setattr(watchdog.urls, 'write_text', refuse)
  monkeypatch.setattr(watchdog.Watchdog, '_reports', lambda self, count: [])
  monkeypatch.setattr(watchdog.os, '_exit', lambda code: (_ for _ in ()).throw(Exited(code)))
  with pytest.raises(Exited):
    guard._fire(700.0)  # pylint: disable=protected-access
  err = capfd.readouterr().err
  assert 'could not write its report to' in err and 'OSError: bucket down' in err
  assert 'no process report could be read' in err


def test_nan_before_the_first_checkpoint_says_there_is_none(tmp_path):
  proc = _launch(tmp_path, '--config.num_train_steps=30', '--config.optimizer=sgd',
                 '--config.learning_rate=1e4', '--config.model.dropout=0')
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr
  assert 'NonFiniteError: step ' in errors[0] and 'there is no checkpoint yet in' in errors[0]
  assert 'step None' not in errors[0]

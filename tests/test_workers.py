"""ArrayRecord shards read by worker processes with random augmentation: exact resume after
SIGKILL at epoch edges, whatever the worker count; the example configs run as docs/getting-started.md says.

The data is the converter's output for ../shared/data/mnist (8,000 train images in 4 shards),
trained with launch/configs/mnist_array_record.py (random shift and erase in 2 workers). 8,000
examples in batches of 128 make 62 batches an epoch, so a checkpoint at step 61 resumes into the
last batch of epoch 0 and one at step 62 into the first batch of epoch 1.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from tests.conftest import ROOT, subprocess_env

STEPS = 75
CONFIG = 'launch/configs/mnist_array_record.py'


def _env() -> dict:
  return subprocess_env()


@pytest.fixture(scope='module')
def shards(tmp_path_factory, mnist_dir):
  out = tmp_path_factory.mktemp('mnist_shards')
  # An earlier conversion's shard (--shards=8) matched the printed glob and was read with them.
  (out / 'train-00007-of-00008.array_record').write_bytes(b'')
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'convert', '--source=mnist',
                         f'--data_dir={mnist_dir}', f'--out={out}'], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert 'train with: --config.data.name=array_record' in proc.stdout.splitlines()[-1]
  assert sorted(p.name for p in out.glob('train-*')) == [
      f'train-{i:05d}-of-00004.array_record' for i in range(4)]
  return out


def _args(shards, workdir, workers: int, steps: int = STEPS, every: int = 0) -> list[str]:
  return [sys.executable, 'launch/train.py', f'--config={CONFIG}', f'--workdir={workdir}',
          '--fake_devices=8', f'--config.data.train_files={shards}/train-*.array_record',
          f'--config.data.eval_files={shards}/eval-*.array_record',
          f'--config.data.workers={workers}', '--config.model.hidden=64',
          f'--config.num_train_steps={steps}', '--config.log_every_steps=1',
          f'--config.checkpoint_every_steps={every}', '--config.eval_every_steps=0']


def _run(args) -> str:
  proc = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _losses(workdir) -> dict[int, float]:
  """step -> loss of the last train record for it (a resumed run appends its own)."""
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return {r['step']: r['loss'] for r in map(json.loads, f) if r['split'] == 'train'}


def _params(workdir, step: int) -> list[np.ndarray]:
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from disttrain.storage import checkpoint  # pylint: disable=g-import-not-at-top
  manager = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'),
                                  item_handlers=checkpoint._handlers())  # pylint: disable=protected-access
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  manager.close()
  return [np.asarray(x) for x in jax.tree.leaves(restored['state']['params'])]


@pytest.fixture(scope='module')
def uninterrupted(shards, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('workers2')
  out = _run(_args(shards, workdir, workers=2))
  assert '(8000 train / 2000 eval)' in out
  return workdir


@pytest.mark.slow
def test_workers_do_not_change_the_data(shards, uninterrupted, tmp_path):
  """workers=0 reads the same batches (the transforms' draws included): the same losses."""
  _run(_args(shards, tmp_path, workers=0))
  assert _losses(tmp_path) == _losses(uninterrupted)  # bitwise


def _kill_after_checkpoint(shards, workdir, every: int) -> None:
  """Trains with 2 workers and SIGKILLs the launcher once checkpoint `every` is complete."""
  proc = subprocess.Popen(_args(shards, workdir, workers=2, steps=10 * every, every=every),
                          cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 240
  try:
    while not (workdir / 'checkpoints' / str(every) / 'data').is_dir():
      assert proc.poll() is None, f'the run ended (code {proc.returncode}) before step {every}'
      assert time.monotonic() < deadline
      time.sleep(0.02)
    time.sleep(0.3)  # orbax renames the finished save into place last: it has committed
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) >= 2, workers  # grain's worker processes
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  _, alive = psutil.wait_procs(workers, timeout=10)
  for p in alive:
    p.kill()
  assert not alive, f'{len(alive)} worker process(es) outlived the killed run'


@pytest.mark.slow
# Killed at the last batch of epoch 0 (its checkpoint's next batch starts epoch 1), relaunched
# with another worker count: both edges at once (a second case, killed at 62 and relaunched with
# a thread, cost 15-19 s; test_workers_do_not_change_the_data covers workers=0 against 2).
@pytest.mark.parametrize('every,relaunch_workers', [(61, 1)])
def test_sigkill_then_relaunch_with_another_worker_count_resumes_bit_exactly(
    shards, uninterrupted, tmp_path, every, relaunch_workers):
  _kill_after_checkpoint(shards, tmp_path, every)
  saved = sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints') if d.isdigit())
  assert saved[-1] == every, saved
  state = json.loads((tmp_path / 'checkpoints' / str(every) / 'data' / 'metadata').read_text())
  assert state['next_batch'] == every  # 61: epoch 0's last batch was trained: next is epoch 1
  out = _run(_args(shards, tmp_path, workers=relaunch_workers))
  assert f'resumed from step {every}' in out
  expected, actual = _losses(uninterrupted), _losses(tmp_path)
  after = range(every + 1, STEPS + 1)
  assert [actual[s] for s in after] == [expected[s] for s in after]  # bitwise
  for a, b in zip(_params(tmp_path, STEPS), _params(uninterrupted, STEPS)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_token_file_example_config(tmp_path):
  """docs/getting-started.md: convert the standard library's text to a .bin, train launch/configs/lm_tokens.py."""
  out = tmp_path / 'text'
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'convert', '--source=text',
                         '--format=tokens', f'--out={out}'], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  ids = np.fromfile(out / 'train.bin', np.uint16)
  assert ids.max() < 256 and (out / 'eval.bin').stat().st_size == 2 * (2**15 + 1)
  stdout = _run([sys.executable, 'launch/train.py', '--config=launch/configs/lm_tokens.py',
                 f'--workdir={tmp_path / "run"}', '--fake_devices=8',
                 f'--config.data.train_files={out}/train.bin',
                 f'--config.data.eval_files={out}/eval.bin', '--config.num_train_steps=40',
                 '--config.eval_every_steps=40', '--config.log_every_steps=1',
                 '--config.data.seq_len=32', '--config.global_batch_size=16'])
  records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').open()]
  train = [r for r in records if r['split'] == 'train']
  # A record every step: one compiled train step (a record every 20 would build a second, quiet
  # one). The mean loss of steps 21-40 against that of steps 1-20.
  assert [r['step'] for r in train] == list(range(1, 41))
  early, late = (np.mean([r['loss'] for r in train[i:i + 20]]) for i in (0, 20))
  assert late < 0.75 * early, (early, late)
  assert train[-1]['tokens_per_sec'] > 0 and 'data_wait_fraction' in train[-1]
  assert records[-1]['split'] == 'eval' and records[-1]['num_examples'] == (2**15 // 32)
  assert 'final eval accuracy' in stdout.splitlines()[-1]


_NO_MAIN_GUARD = '''
import disttrain
from disttrain import config
cd = config.defaults()
cd.data.workers, cd.num_train_steps, cd.global_batch_size = 1, 2, 8
disttrain.train(disttrain.from_config_dict(cd), 'WORKDIR')
'''


@pytest.mark.slow  # two script processes, one training (9.5 s of the quick tier)
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
  """Each worker imports the script; one that trains at its top level trained again in the
  worker, which failed, and the parent hung writing the worker's start-up data (SIGTERM too)."""
  script = tmp_path / 'train_here.py'
  script.write_text(_NO_MAIN_GUARD.replace('WORKDIR', str(tmp_path / 'run')))
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                        text=True, timeout=120, check=False, env=subprocess_env())
  assert proc.returncode != 0
  assert proc.stderr.splitlines()[-1].endswith(
      f"data.workers=1: {script} starts training at its top level (line 6) and each worker "
      "process imports it; put that under `if __name__ == '__main__':` or set data.workers=0"), \
      proc.stderr[-2000:]
  # Under the guard it trains.
  script.write_text(_NO_MAIN_GUARD.replace('WORKDIR', str(tmp_path / 'run')).replace(
      'disttrain.train(', "if __name__ == '__main__':\n  disttrain.train("))
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                        text=True, timeout=120, check=False, env=subprocess_env())
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_worker_room_counts_the_memory_the_kernel_can_reclaim():
  """MemAvailable (psutil's `available`), not MemFree: page cache left most workers refused."""
  from disttrain.data import workers  # pylint: disable=g-import-not-at-top
  available = workers._available_memory()  # pylint: disable=protected-access
  assert abs(available - psutil.virtual_memory().available) < 2**28

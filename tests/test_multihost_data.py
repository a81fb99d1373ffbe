"""Two processes found by jax.distributed's SLURM detection train a user's ArrayRecord data.

The processes get the environment srun gives a 2-task job on this host (job id, task count, proc
id, local id, node list) and `launch/train.py --distributed` with no address: JAX reads the job
from that environment. Their data, model and task come from tests/configs/user_data.py (a config
file's get_data / get_model / get_task), whose source logs every batched read. Tolerances as in
tests/test_multiprocess.py: rtol 1e-4 over 10 steps, 1e-2 over 30.
"""

import json
import runpy
import socket
import subprocess
import sys

import numpy as np
import pytest

import disttrain
from disttrain import config as config_lib
from disttrain.data import formats
from tests import helpers
from tests.conftest import ROOT, subprocess_env

pytestmark = pytest.mark.slow  # a 2-process cluster and its 1 x 8 reference
from tests.test_user_data import EVAL, _breast_cancer

CONFIG = ROOT / 'tests' / 'configs' / 'user_data.py'


def _write_shards(folder) -> tuple[str, str]:
  train, held_out = _breast_cancer()
  formats.write_array_record(str(folder / 'train'), train, 4)
  formats.write_array_record(str(folder / 'eval'), held_out, 2)
  return str(folder / 'train-*.array_record'), str(folder / 'eval-*.array_record')


def _slurm_port() -> tuple[int, int]:
  """(job id, port) with the port JAX derives from the job id free here, and the next one."""
  for job in range(4000, 4096):
    port = job % 2**12 + (65535 - 2**12 + 1)
    try:
      with socket.socket() as a, socket.socket() as b:
        a.bind(('127.0.0.1', port))
        b.bind(('127.0.0.1', port + 1))
      return job, port
    except OSError:
      continue
  raise RuntimeError('no free port in the SLURM range')


def _reads(path) -> list[list[int]]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def test_slurm_detected_two_processes_read_their_rows_and_match_one(tmp_path, monkeypatch):
  train_files, eval_files = _write_shards(tmp_path)
  overrides = {'data.train_files': train_files, 'data.eval_files': eval_files}
  job, _ = _slurm_port()
  host = socket.gethostname()
  two = tmp_path / 'two'
  procs = []
  for i in range(2):
    env = subprocess_env(READS_DIR=str(tmp_path), SLURM_JOB_ID=str(job), SLURM_NTASKS='2',
                         SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_STEP_NODELIST=host,
                         SLURM_STEP_NUM_NODES='1', SLURM_NODELIST=host)
    procs.append(subprocess.Popen(
        [sys.executable, 'launch/train.py', '--distributed', f'--config={CONFIG}',
         f'--workdir={two}', '--fake_devices=4', '--distributed_init_timeout=60',
         '--distributed_heartbeat_timeout=20', '--config.watchdog_seconds=60',
         *(f'--config.{k}={v}' for k, v in overrides.items())],
        cwd=ROOT, env=env, stdout=(tmp_path / f'out_{i}.txt').open('w'),
        stderr=subprocess.STDOUT, start_new_session=True))
  try:
    for p in procs:
      p.wait(timeout=240)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  outs = [(tmp_path / f'out_{i}.txt').read_text() for i in range(2)]
  assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  info = json.loads((two / 'run.json').read_text())
  assert (info['num_processes'], info['num_devices']) == (2, 8)

  # The 1 x 8 reference, in this process, from the same config file's functions.
  module = runpy.run_path(str(CONFIG))
  cfg = config_lib.from_config_dict(helpers.override(module['get_config'](), overrides))
  monkeypatch.setenv('READS_DIR', str(tmp_path / 'one'))
  (tmp_path / 'one').mkdir()
  result = disttrain.train(cfg, str(tmp_path / 'ref'), model=module['get_model'](cfg),
                           task=module['get_task'](cfg), **module['get_data'](cfg))
  want = {r['step']: r['loss'] for r in result.records if r['split'] == 'train'}
  with open(two / 'metrics.jsonl', encoding='utf-8') as f:
    records = [json.loads(line) for line in f]
  got = {r['step']: r['loss'] for r in records if r['split'] == 'train'}
  steps = list(range(1, 31))
  assert sorted(got) == steps
  np.testing.assert_allclose([got[s] for s in steps[:10]], [want[s] for s in steps[:10]],
                             rtol=1e-4)
  np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-2)
  assert records[-1]['split'] == 'eval' and records[-1]['num_examples'] == EVAL

  # Each process read half of every global batch, the halves disjoint, together the batch.
  reference = _reads(tmp_path / 'one' / 'reads_0.jsonl')
  first, second = _reads(tmp_path / 'reads_0.jsonl'), _reads(tmp_path / 'reads_1.jsonl')
  assert len(reference) == len(first) == len(second) == 30
  for whole, a, b in zip(reference, first, second):
    assert len(whole) == 64 and len(a) == len(b) == 32
    assert not set(a) & set(b) and sorted(a + b) == sorted(whole)

"""Real multi-process jobs: launch/local_cluster.py, 2 processes x 4 CPU devices over gloo.

Each job is a subprocess tree (the launcher and its 2 workers), run one at a time: on 2 cores,
XLA:CPU collectives time out when several multi-device jobs share the machine. The 1 x 8
references run in this pytest process (8 fake devices, conftest.py), never beside a job.

Tolerances, as in tests/test_equivalence.py: 2 x 4 and 1 x 8 compute the same global batches
and differ only in the order of the cross-device sums (gloo between processes, XLA's in-process
all-reduce within one), ~1e-7 relative per step, amplified by training: rtol 1e-4 over the
first 10 steps and 1e-2 over 30. Two 2 x 4 runs of one config are bitwise equal (same
reduction order), so a resumed 2 x 4 run must equal an uninterrupted one exactly.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import psutil
import pytest

import disttrain
from disttrain import config as config_lib
from disttrain.operating import events, goodput
from disttrain.parallel import distributed
from disttrain.storage import urls
from tests import buckets, helpers
from tests.conftest import ROOT, subprocess_env

pytestmark = pytest.mark.slow  # each test starts a cluster of processes

CONFIG = 'launch/configs/mnist_mlp.py'
OPS = 'tests/configs/ops.py'  # the same config (and data) as CONFIG, plus hooks chosen by env
STEPS = 30
DIGITS_EVAL = 297  # not a multiple of 2 processes x eval batch 64: the last batch is padded
BASE = {'model.hidden': 64, 'global_batch_size': 64, 'eval_batch_size': 64,
        'num_train_steps': STEPS, 'log_every_steps': 1, 'checkpoint_every_steps': 10,
        'eval_every_steps': 0}
CASES = {
    # jit keeps the config's dropout 0.3: its mask is drawn for the global batch (threefry is
    # partitionable), so it does not depend on how the batch is split over processes.
    'jit': {},
    # A hybrid mesh: data across the 2 processes (dcn_mesh), fsdp x tensor inside each;
    # fsdp_min_size lowered so that the 64-wide kernels really are split over fsdp. The 1 x 8
    # reference lays the same axes out flat (mesh.data=2).
    'hybrid': {'dcn_mesh.data': 2, 'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.tensor': 2,
               'sharding': 'fsdp', 'fsdp_min_size': 1024},
    # No shard_map case (cut, 18 s): the 2-process path (batches assembled from each process's
    # rows, all-reduce over gloo) does not depend on step_mode, which jit and fsdp prove here, and
    # shard_map == jit on 8 devices is test_equivalence.py's shard_map8 (one step and 30 steps).
}
JOB_TIMEOUT = 240


def _env() -> dict:
  return subprocess_env()


def _cluster_cmd(*args: str, grace: float = 20, timeout: int = JOB_TIMEOUT) -> list[str]:
  return [sys.executable, 'launch/local_cluster.py', '--num_processes=2',
          '--devices_per_process=4', f'--timeout={timeout}', f'--grace={grace}', *args]


def _train_flags(overrides: dict, workdir, config: str = CONFIG) -> list[str]:
  return ['--', f'--config={config}', f'--workdir={workdir}',
          *(f'--config.{k}={v}' for k, v in overrides.items())]


def _cluster(overrides: dict, workdir, env: dict | None = None, grace: float = 20,
             timeout: int = JOB_TIMEOUT) -> str:
  """Runs a 2 x 4 training job to the end (local_cluster stops it after `timeout` s)."""
  proc = subprocess.run(_cluster_cmd(*_train_flags(overrides, workdir), grace=grace,
                                     timeout=timeout),
                        cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True, text=True,
                        timeout=timeout + 60, check=False)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-4000:]
  return out


def _start_cluster(overrides: dict, workdir, grace: float = 20, config: str = CONFIG,
                   env: dict | None = None) -> subprocess.Popen:
  command = _cluster_cmd(*_train_flags(overrides, workdir, config), grace=grace)
  return subprocess.Popen(helpers.foreground(command), cwd=ROOT, env={**_env(), **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ops_cluster(workdir, env: dict, overrides: dict, grace: float = 20) -> subprocess.Popen:
  """A job of OPS with its test hooks chosen by `env`."""
  return _start_cluster(overrides, workdir, grace, OPS, env)


def _config(overrides: dict) -> disttrain.Config:
  """The same Config that launch/train.py builds from CONFIG and these overrides."""
  return config_lib.from_config_dict(helpers.override(helpers.config_file(ROOT / CONFIG),
                                                     overrides))


def _records(workdir, split: str) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [r for r in map(json.loads, f) if r['split'] == split]


def _losses(workdir) -> dict[int, float]:
  """step -> loss of the train records (each step once, also after a resume)."""
  return {r['step']: r['loss'] for r in _records(workdir, 'train')}


def _last_logged_step(workdir) -> int:
  try:
    return max((r['step'] for r in _records(workdir, 'train')), default=0)
  except (OSError, json.JSONDecodeError):  # not written yet, or a line half written
    return 0


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """case -> (2 x 4 workdir, 1 x 8 workdir), each trained once for STEPS steps on first use."""
  done = {}

  def get(case: str):
    if case not in done:
      overrides = {**BASE, **CASES[case]}
      two = tmp_path_factory.mktemp(f'{case}_2x4')
      _cluster(overrides, two)
      one = tmp_path_factory.mktemp(f'{case}_1x8')
      if 'dcn_mesh.data' in overrides:  # one process: the same sizes in a flat mesh
        overrides = dict(overrides)
        overrides['mesh.data'] = overrides.pop('dcn_mesh.data')
      disttrain.train(_config(overrides), str(one))
      done[case] = two, one
    return done[case]
  return get


# ----------------------------------------------------------------------------------------------
# 1. 2 processes x 4 devices compute what 1 process x 8 devices computes.

@pytest.mark.parametrize('case', list(CASES))
def test_two_processes_match_one(runs, case):
  two, one = runs(case)
  info = json.loads((two / 'run.json').read_text())
  assert (info['num_processes'], info['num_devices']) == (2, 8)
  if case == 'hybrid':  # parameters really are split, and only data crosses the processes
    assert any('fsdp' in spec for spec in info['param_specs'].values()), info['param_specs']
    assert any('tensor' in spec for spec in info['param_specs'].values()), info['param_specs']
    assert info['mesh'] == {'data': 2, 'stage': 1, 'fsdp': 2, 'expert': 1, 'context': 1,
                            'tensor': 2}
    assert info['dcn_axes'] == ['data']
    processes = np.asarray(info['mesh_process_index']).reshape(2, -1)  # data outermost
    assert processes.tolist() == [[0] * 4, [1] * 4], info['mesh_process_index']
    assert json.loads((one / 'run.json').read_text())['dcn_axes'] == []
  got, want = _losses(two), _losses(one)
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  steps = sorted(want)
  np.testing.assert_allclose([got[s] for s in steps[:10]], [want[s] for s in steps[:10]],
                             rtol=1e-4)
  np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-2)
  # No false alarm: nothing stalled here (operating/stragglers.py).
  assert [e for e in events.read(str(two)) if e['event'] == 'straggler'] == []
  (eval_two,), (eval_one,) = _records(two, 'eval'), _records(one, 'eval')
  # Every eval example counted once although 297 does not split over 2 processes x 64.
  assert eval_two['num_examples'] == eval_one['num_examples'] == DIGITS_EVAL
  assert abs(eval_two['accuracy'] - eval_one['accuracy']) <= 0.005


def test_a_job_run_again_over_a_warm_compilation_cache_finishes_bitwise_equal(tmp_path):
  """jax 0.12.1's cached CPU executables deadlocked a second 2 x 4 job in its first collective
  (distributed._no_compilation_cache_across_cpu_processes); the rerun must finish, and equal."""
  env = {'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'cache')}
  overrides = {**BASE, 'num_train_steps': 3, 'checkpoint_every_steps': 0}
  # A deadlock is stopped well before JOB_TIMEOUT: the job takes ~8 s.
  outs = [_cluster(overrides, tmp_path / run, env, grace=5, timeout=90)
          for run in ('first', 'again')]
  assert 'persistent compilation cache' in outs[-1]
  assert _losses(tmp_path / 'again') == _losses(tmp_path / 'first')


# ----------------------------------------------------------------------------------------------
# 2. Each process reads exactly the rows its devices hold; together, every example once.

def test_processes_read_their_rows_and_together_every_example_once(tmp_path):
  proc = subprocess.run(_cluster_cmd('--program=tests/mp_ids.py', '--', f'--out={tmp_path}'),
                        cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=JOB_TIMEOUT + 60, check=False)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  reports = [json.loads((tmp_path / f'ids_{p}.json').read_text()) for p in (0, 1)]
  meta = reports[0]
  batch, steps, n_train = meta['batch'], meta['steps'], meta['train_examples']
  epoch = n_train // batch
  assert n_train == epoch * batch and steps == 2 * epoch  # whole epochs: no remainder dropped
  train_ids = np.arange(n_train)  # example ids are indices into their own source
  eval_ids = np.arange(meta['eval_examples'])
  for name in meta['layouts']:
    layouts = [r['layouts'][name] for r in reports]
    rows = [set(l['local_rows']) for l in layouts]
    assert rows[0].isdisjoint(rows[1]) and rows[0] | rows[1] == set(range(batch)), name
    if name.startswith('interleaved'):  # rows follow the devices, not the process index
      assert sorted(rows[0]) != list(range(batch // 2)), rows[0]
    for layout in layouts:
      # mp_ids checked each device's rows against a 1-device iterator; here: what a process
      # gathered from the data is exactly what its devices hold, half of each batch.
      assert layout['read_ids'] == layout['held_ids'], name
      assert {len(ids) for ids in layout['read_ids']} == {batch // 2}, name
      assert layout['last_batch_id_sum'] == layout['last_reference_id_sum'], name
    orders = []
    for e in range(2):
      ids = np.concatenate([np.concatenate(l['read_ids'][e * epoch:(e + 1) * epoch])
                            for l in layouts])
      np.testing.assert_array_equal(np.sort(ids), train_ids, err_msg=f'{name} epoch {e}')
      orders.append(np.concatenate(layouts[0]['read_ids'][e * epoch:(e + 1) * epoch]))
    assert not np.array_equal(orders[0], orders[1]), 'each epoch has its own order'
    # Eval: 325 = 5 x 64 + 5 examples; both processes run the same 6 batches (no one waits on
    # a collective), and together they count every eval example once.
    assert [l['eval_batches'] for l in layouts] == [-(-meta['eval_examples'] // batch)] * 2
    assert [l['eval_count'] for l in layouts] == [meta['eval_examples']] * 2
    np.testing.assert_array_equal(np.sort(layouts[0]['eval_ids'] + layouts[1]['eval_ids']),
                                  eval_ids, err_msg=name)


# ----------------------------------------------------------------------------------------------
# 3. Checkpoints move between process counts, with the data position.

def _copy_without_last(source, tmp_path):
  """A copy of a finished run whose newest checkpoint is step 20 (step 30 removed)."""
  workdir = tmp_path / 'run'
  shutil.copytree(source, workdir)
  shutil.rmtree(workdir / 'checkpoints' / str(STEPS))
  data_state = json.loads((workdir / 'checkpoints' / '20' / 'data' / 'metadata').read_text())
  # The iterator position counts global batches: it does not depend on the process count.
  assert data_state['next_batch'] == 20, data_state
  return workdir


def test_checkpoint_of_two_processes_resumes_in_one(runs, tmp_path):
  two, _ = runs('jit')
  workdir = _copy_without_last(two, tmp_path)
  result = disttrain.train(_config({**BASE, **CASES['jit']}), str(workdir))
  resumed = {r['step']: r['loss'] for r in result.records if r['split'] == 'train'}
  assert sorted(resumed) == list(range(21, STEPS + 1))
  # Same state and same next batches: only the reduction order differs from the 2 x 4 run.
  want = _losses(two)
  np.testing.assert_allclose([resumed[s] for s in sorted(resumed)],
                             [want[s] for s in sorted(resumed)], rtol=1e-4)


def test_checkpoint_of_one_process_resumes_in_two(runs, tmp_path):
  _, one = runs('jit')
  workdir = _copy_without_last(one, tmp_path)
  out = _cluster({**BASE, **CASES['jit']}, workdir)
  assert '[0] resumed from step 20' in out
  got, want = _losses(workdir), _losses(one)
  after = range(21, STEPS + 1)
  np.testing.assert_allclose([got[s] for s in after], [want[s] for s in after], rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# 4. Failures: a dead worker stops the job; SIGTERM saves on every process and resumes exactly.

def _job_processes(workdir) -> list[psutil.Process]:
  """Live processes whose command line names this job's workdir."""
  found = []
  for p in psutil.process_iter(['cmdline']):
    try:
      if any(str(workdir) in arg for arg in (p.info['cmdline'] or ())):
        found.append(p)
    except psutil.Error:
      continue
  return found


def _workers(proc: subprocess.Popen) -> dict[int, psutil.Process]:
  """process id -> the launcher's child running it."""
  return {int(a.split('=')[1]): p for p in psutil.Process(proc.pid).children()
          for a in p.cmdline() if a.startswith('--process_id=')}


def _wait_for_step(proc: subprocess.Popen, workdir, step: int, timeout: float = 180) -> None:
  deadline = time.monotonic() + timeout
  while _last_logged_step(workdir) < step:
    assert proc.poll() is None, f'the job ended (code {proc.returncode}) before step {step}'
    assert time.monotonic() < deadline, f'no step {step} after {timeout}s'
    time.sleep(0.05)


def test_killed_worker_stops_the_job_without_orphans(tmp_path):
  # A long run: it must still be training when the worker dies. --grace 1 instead of the
  # default 20 s: the survivor is stuck in a collective with the dead process and can only be
  # SIGKILLed once the grace has passed (measured with the default: 21 s to exit).
  proc = _start_cluster({**BASE, 'num_train_steps': 1000, 'checkpoint_every_steps': 0},
                        tmp_path, grace=1)
  try:
    _wait_for_step(proc, tmp_path, 3)
    workers = _workers(proc)
    assert sorted(workers) == [0, 1]
    workers[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    elapsed = time.monotonic() - killed_at
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
  assert 'local_cluster: process 1 killed by SIGKILL; stopped the other 1 process(es)' in out
  assert elapsed < 120
  time.sleep(0.5)
  assert not _job_processes(tmp_path), 'orphan processes of the job remain'


@pytest.mark.parametrize('fail_at,failing', [('setup', 1), ('6', 1), ('6', 0), ('exit', 1)])
def test_a_process_that_fails_stops_the_others_at_once(tmp_path, fail_at, failing):
  """A process meets bad data: in get_data while setting up, or on its 6th read while training
  (process 0 too, which hosts jax.distributed's store); or a callback of the user's calls
  sys.exit(7) on it. The other, waiting for it in a collective, says why and exits with its
  status by itself (disttrain/parallel/failures.py): well before the launcher's grace of 120 s
  would SIGKILL it, as it had to before (and as a scheduler's timeout would, without a launcher
  that watches)."""
  grace, other = 120, 1 - failing
  env = ({'RAISE_IN': 'on_train_record', 'EXIT': '7'} if fail_at == 'exit' else
         {'FAIL_AT': fail_at})
  proc = _ops_cluster(tmp_path, {**env, 'FAIL_PROCESS': str(failing)},
                      {**BASE, 'num_train_steps': 1000}, grace)
  start = time.monotonic()
  try:
    out, _ = proc.communicate(timeout=JOB_TIMEOUT + grace)
  finally:
    if proc.poll() is None:
      proc.kill()
  elapsed = time.monotonic() - start
  status, line = (7, 'sys.exit(7)') if fail_at == 'exit' else (2, 'DataError: ')
  assert proc.returncode == status, out[-3000:]
  assert fail_at == 'exit' or f'[{failing}] error: DataError: ' in out, out[-3000:]
  assert (f'[{other}] error: process {failing} failed, so this process stops too (exit '
          f'{status}): {line}' in out), out[-3000:]
  assert 'Traceback' not in out, out[-3000:]
  assert elapsed < grace - 20, (elapsed, out[-3000:])  # start-up and all: ~10 s here
  time.sleep(0.5)
  assert not _job_processes(tmp_path), 'orphan processes of the job remain'
  # Process 0 closed its records as it left, also when it was the one taken out: the attempt's
  # end names why, and the lease is free for the relaunch (else it waits out lease_seconds).
  assert not (tmp_path / 'lease.json').exists()
  if fail_at != 'setup':  # at set-up process 0 may not have started its event log yet
    end = [json.loads(line) for line in (tmp_path / 'events.jsonl').read_text().splitlines()][-1]
    assert end['event'] == 'end' and end['error'] == ('DataError' if failing == 0 else
                                                      'PeerFailed'), end  # process 0 writes
    assert failing == 0 or end['process'] == failing, end
    assert end['breakdown']['wall_seconds'] > 0, end  # goodput costs its time as it went
    assert isinstance(end.get('step'), int), end  # goodput divides the step seconds by it


def _users_program(tmp_path, **env) -> tuple[list, list[str]]:
  """tests/mp_train_api.py on two processes of 4 devices, started without a launcher: the
  processes (ended) and their outputs."""
  port = distributed.free_port_pair()
  procs = [subprocess.Popen(
      [sys.executable, 'tests/mp_train_api.py', f'--coordinator_address=127.0.0.1:{port}',
       '--num_processes=2', f'--process_id={i}', '--fake_devices=4', f'--out={tmp_path}'],
      cwd=ROOT, env={**_env(), **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in (0, 1)]
  try:
    return procs, [p.communicate(timeout=JOB_TIMEOUT)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


@pytest.mark.parametrize('failing', [1, 0])
def test_a_program_of_the_users_stops_with_a_failing_process(tmp_path, failing):
  """No launcher: each process runs the user's program (tests/mp_train_api.py), which joins the
  job and calls disttrain.train twice; in the second run one process meets bad data. It raises as
  a Python program does (traceback, exit 1); the other, waiting for it in a collective, says why
  and exits 2 by itself, and both are gone within seconds: before, the other waited for jax's
  heartbeat timeout (100 s) and the failing one, at its exit, in jax's shutdown barrier for it."""
  start = time.monotonic()
  procs, outs = _users_program(tmp_path, FAIL_AT='6', FAIL_PROCESS=str(failing))
  elapsed = time.monotonic() - start
  failed, other = outs[failing], outs[1 - failing]
  assert all('first run ended at step 3' in out for out in outs), outs
  assert procs[failing].returncode == 1, failed[-3000:]
  assert 'Traceback' in failed and f'DataError: read 6 of process {failing} failed' in failed
  assert procs[1 - failing].returncode == 2, other[-3000:]
  assert (f'error: process {failing} failed, so this process stops too (exit 2): DataError: read '
          f'6 of process {failing}') in other, other[-3000:]
  assert 'Traceback' not in other and not any('Check failure' in out for out in outs), outs
  assert elapsed < 60, (elapsed, outs)  # start-up and two runs: ~16 s here
  second = tmp_path / 'second'
  assert not (second / 'lease.json').exists()
  end = [json.loads(line) for line in (second / 'events.jsonl').read_text().splitlines()][-1]
  assert end['event'] == 'end' and end['error'] == ('DataError' if failing == 0 else
                                                    'PeerFailed'), end


def test_a_nan_on_every_process_reaches_every_program(tmp_path):
  """A NaN loss is every process's (the loss is global): each program gets the NonFiniteError
  and goes on, even one process behind (its reads slow). Posted as a failure, it took that
  process out before it raised, and the first one's exit hung for good on its last dispatched
  step, a collective the other never joined."""
  procs, outs = _users_program(tmp_path, DIVERGE_LR='1e30', SLOW_READS='2', SLOW_PROCESS='1')
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
    assert 'second run raised NonFiniteError: step 2: loss=nan' in out, out[-3000:]
    assert 'so this process stops too' not in out, out[-3000:]


def test_workers_do_not_outlive_a_killed_launcher(tmp_path):
  # SIGKILL leaves the launcher no time to stop anyone (a CI timeout, the OOM killer); the
  # workers, each in its own session, must die with it. Stand-in workers that only sleep.
  sleeper = tmp_path / 'sleeper.py'
  sleeper.write_text('import time\ntime.sleep(300)\n')
  proc = subprocess.Popen(_cluster_cmd(f'--program={sleeper}'), cwd=ROOT, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 60
  workers = []
  while len(workers) < 2:
    assert time.monotonic() < deadline, 'the workers did not start'
    time.sleep(0.05)
    workers = [p for p in _job_processes(sleeper) if p.pid != proc.pid]
  proc.kill()
  proc.wait()
  _, alive = psutil.wait_procs(workers, timeout=10)
  for p in alive:
    p.kill()  # do not leave them behind when this test fails
  assert not alive, f'{len(alive)} worker(s) outlived the launcher'


def _assert_committed(step_dir) -> None:
  """The step's checkpoint was finalized by the job: its state and data items are in place.

  Process 0 writes this model's state alone: its replicated arrays are under
  storage/checkpoint.py's MIN_REPLICA_SLICE_BYTES a replica, so the first replica writes each
  whole; process 1's part in the save is its log line and the barrier the commit waits for."""
  assert (step_dir / 'state' / 'ocdbt.process_0').is_dir(), sorted(os.listdir(step_dir))
  assert (step_dir / 'data').is_dir(), sorted(os.listdir(step_dir))
  assert not any('tmp' in name for name in os.listdir(step_dir.parent)), os.listdir(step_dir.parent)


def _interrupt(overrides: dict, workdir, after: int, sig: int, exit_code: int, said: str) -> int:
  """Starts the job, sends `sig` to the launcher once step `after` is logged, checks that every
  process saved one checkpoint at one agreed step and exited with `exit_code`; returns the step.

  Batches are read slowly (0.25 s each, the same data): agreeing on a stop took jax's
  preemption service 0.5-1.3 s here (it polls for SIGTERM once a second; 2-10 steps later), and
  a run that reaches its last step first ends normally (exit 0), as 12 steps of 0.1 s once did."""
  proc = _ops_cluster(workdir, {'SLOW_READS': '0.25'}, overrides)
  try:
    _wait_for_step(proc, workdir, after)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == exit_code, out[-3000:]
  assert 'Traceback' not in out, out[-3000:]
  saved = {int(line.split('at step ')[1].split()[0]) for line in out.splitlines()
           if f'{said}: saved a checkpoint at step' in line}
  processes = [p for p in (0, 1) if f'[{p}] {said}: saved a checkpoint' in out]
  assert processes == [0, 1] and len(saved) == 1, out[-3000:]  # both processes, one agreed step
  (at,) = saved
  assert after <= at < STEPS, (after, at)
  _assert_committed(workdir / 'checkpoints' / str(at))
  return at


def test_sigterm_then_ctrl_c_save_on_every_process_and_resume_exactly(runs, tmp_path):
  """SIGTERM to the launcher (forwarded to every process: exit 75), relaunch, Ctrl-C (SIGINT to
  the launcher: exit 130, no traceback), relaunch: the steps after each resume are bitwise the
  uninterrupted 2 x 4 run's, and so is the final eval.

  A checkpoint every step in the two interrupted runs (the same numerics): orbax's save passes its
  step number to jax's preemption sync, which counts calls; after a resume the two differ, and a
  signal that reached the job just after a save was agreed for a call that never came (the job
  trained on). The last relaunch, never signalled, saves every 10 steps (a save costs more than
  a step here)."""
  two, _ = runs('jit')  # the uninterrupted 2 x 4 run of the same config
  overrides = {**BASE, **CASES['jit'], 'checkpoint_every_steps': 1}
  first = _interrupt(overrides, tmp_path, 4, signal.SIGTERM, disttrain.Preempted.exit_code,
                     'preempted')  # after a few steps' checkpoints were started
  second = _interrupt(overrides, tmp_path, first + 3, signal.SIGINT,
                      disttrain.Interrupted.exit_code, 'interrupted')
  assert disttrain.Interrupted.exit_code == 130
  out = _cluster({**overrides, 'checkpoint_every_steps': 10}, tmp_path)
  assert f'[0] resumed from step {second}' in out
  got, want = _losses(tmp_path), _losses(two)
  after = range(first + 1, STEPS + 1)
  assert [got[s] for s in after] == [want[s] for s in after]  # bitwise
  assert _records(tmp_path, 'eval')[-1] == _records(two, 'eval')[-1]


def test_sigterm_to_one_worker_stops_all_with_several_steps_per_dispatch(tmp_path):
  # As when one host of a pod is preempted: only worker 1 gets SIGTERM, and jax's preemption
  # service tells the other. Step numbers advance by 2 here; the sync point must still be met
  # (it is a call count: with the step number passed, this job ignored SIGTERM and trained on).
  proc = _start_cluster({**BASE, 'num_train_steps': 1000, 'steps_per_dispatch': 2,
                         'log_every_steps': 2, 'checkpoint_every_steps': 0}, tmp_path)
  try:
    _wait_for_step(proc, tmp_path, 6)
    _workers(proc)[1].send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == disttrain.Preempted.exit_code, out[-3000:]
  saved = {(line[:3], line.split('at step ')[1].split()[0]) for line in out.splitlines()
           if 'preempted: saved a checkpoint at step' in line}
  assert {p for p, _ in saved} == {'[0]', '[1]'} and len({s for _, s in saved}) == 1, saved
  assert int(saved.pop()[1]) % 2 == 0


# ----------------------------------------------------------------------------------------------
# 5. The roll call names who is missing.

@pytest.mark.parametrize('process_id,missing', [(0, 'process(es) [1] of 2 did not join'),
                                                (1, 'the coordinator (process 0 at')])
def test_process_started_alone_names_the_missing_one(tmp_path, process_id, missing):
  port = distributed.free_port_pair()
  proc = subprocess.run(
      [sys.executable, 'launch/train.py', f'--config={CONFIG}', f'--workdir={tmp_path}',
       '--fake_devices=4', f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
       f'--process_id={process_id}', '--distributed_init_timeout=1'],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and 'DistributedError' in errors[0] and missing in errors[0], \
      proc.stderr
  assert 'Traceback' not in proc.stderr
  with socket.socket() as s:  # the roll call's listener was closed
    s.bind(('127.0.0.1', port + 1))


def test_the_roll_call_waits_for_a_name_that_resolves_late_and_takes_an_ipv6_address(monkeypatch):
  """A Kubernetes pod can start before pod 0's DNS record exists: process 1 retried only a refused
  connection and failed at once on 'Name or service not known'. '[::1]:P', as jax.distributed
  takes it, was passed on with its brackets and the listener was IPv4 only."""
  port, real, start = distributed.free_port_pair(), socket.getaddrinfo, time.monotonic()

  def resolves_late(host, *args, **kwargs):
    if host == 'pod-0.starting':
      if time.monotonic() - start < 1.5:
        raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')
      host = '127.0.0.1'
    return real(host, *args, **kwargs)
  monkeypatch.setattr(socket, 'getaddrinfo', resolves_late)
  monkeypatch.setattr(distributed, '_ID_SECONDS', 1.0)
  for address in (f'pod-0.starting:{port}', f'[::1]:{port}'):
    errors = []
    coordinator = threading.Thread(target=lambda: _record_error(
        errors, distributed._roll_call, address, 2, 0, 30))  # pylint: disable=protected-access
    coordinator.start()
    # A port probe that connects first and sends nothing held the roll call to its deadline.
    probe = _connect_when_listening(port + 1)
    distributed._roll_call(address, 2, 1, 30)  # pylint: disable=protected-access
    coordinator.join()
    probe.close()
    assert not errors, (address, errors)
  assert 1.5 <= time.monotonic() - start < 20  # the first address did wait for its name


def _connect_when_listening(port: int) -> socket.socket:
  for _ in range(100):
    try:
      return socket.create_connection(('127.0.0.1', port))
    except ConnectionRefusedError:
      time.sleep(0.05)
  raise AssertionError(f'nothing listens on {port}')


def _record_error(errors, fn, *args):
  try:
    fn(*args)
  except Exception as e:  # pylint: disable=broad-except
    errors.append(e)


@pytest.mark.parametrize('flag,message', [
    ('--timeout=-5', 'error: --timeout=-5 must be > 0 and --grace=20 >= 0'),  # it ran, stopped
    ('--num_processes=0', 'error: --num_processes=0 and --devices_per_process=4 must both be'),
    ('--grace=abc', "error: --grace='abc' is not a float value"),
    # After --, absl kept the launcher's own value (appended last): 2 x 4 devices, exit 0.
    ('-- --num_processes=1', 'error: --num_processes=1 after -- is set by the launcher for each '
     'process; drop it and pass --num_processes=N before --'),
    ('-- --fake_devices=8', 'error: --fake_devices=8 after -- is set by the launcher for each '
     'process; drop it and pass --devices_per_process=N before --'),
])
def test_bad_cluster_flags_are_one_line(flag, message):
  proc = subprocess.run([sys.executable, 'launch/local_cluster.py', *flag.split(), '--',
                         '--config=x'],
                        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
  assert proc.stderr.startswith(message), proc.stderr


@pytest.mark.parametrize('flags,message', [
    (['--distributed', '--num_processes=2', '--process_id=0'],  # no address, no cluster
     ['detected no cluster', '--coordinator_address=HOST:PORT']),
    # JAX's own ValueError was reworded as 'not all None processes joined within 3s'.
    (['--coordinator_address=127.0.0.1:{port}', '--process_id=1'],
     ['cannot start: Number of processes must be defined;', 'pass --num_processes=N']),
])
def test_distributed_without_a_cluster_or_a_count_says_so(tmp_path, flags, message):
  port = distributed.free_port_pair()
  proc = subprocess.run(
      [sys.executable, 'launch/train.py', f'--config={CONFIG}', f'--workdir={tmp_path}',
       '--fake_devices=4', '--distributed_init_timeout=3'] + [f.format(port=port) for f in flags],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and all(m in errors[0] for m in message), proc.stderr
  assert 'Traceback' not in proc.stderr


# ----------------------------------------------------------------------------------------------
# 6. Operating a job: a callback's stop, Ctrl-C, the hang watchdog.

def test_callback_stop_is_agreed_and_saved(runs, tmp_path):
  """A callback asks to stop when it sees step 17's record (fetched one step late, after step
  18 was dispatched): both processes stop after step 18, save it, exit 0, and their losses so far
  are the uninterrupted run's. (A relaunch after an agreed save continues bitwise:
  test_sigterm_then_ctrl_c_save_on_every_process_and_resume_exactly.)"""
  two, _ = runs('jit')
  overrides = {**BASE, **CASES['jit']}
  proc = _ops_cluster(tmp_path, {'STOP_AT': '17'}, overrides)
  out, _ = proc.communicate(timeout=JOB_TIMEOUT)
  assert proc.returncode == 0, out[-3000:]
  stops = [line for line in out.splitlines() if 'stopped at step 18 of 30: StopAt: saw step 17'
           in line]
  assert [line[:3] for line in stops] == ['[0]'], out[-3000:]  # process 0 prints for the job
  assert 'Traceback' not in out
  _assert_committed(tmp_path / 'checkpoints' / '18')
  assert json.loads((tmp_path / 'run.json').read_text())['stopped_by'] == 'StopAt: saw step 17'
  got, want = _losses(tmp_path), _losses(two)
  assert [got[s] for s in range(1, 19)] == [want[s] for s in range(1, 19)]


def test_watchdog_names_the_process_that_hung(tmp_path):
  """Process 1's data source blocks for good on its 4th read; process 0 then waits in the step's
  collective. Within watchdog_seconds + 30 s the job ends non-zero, each process wrote its
  stacks, and process 0 names process 1."""
  seconds = 5
  proc = _ops_cluster(tmp_path, {'HANG_AFTER': '4'},
                      {**BASE, 'num_train_steps': 1000, 'watchdog_seconds': seconds}, grace=5)
  start = time.monotonic()
  try:
    out, _ = proc.communicate(timeout=seconds + 90)
  finally:
    if proc.poll() is None:
      proc.kill()
  elapsed = time.monotonic() - start
  assert proc.returncode not in (0, None), out[-3000:]
  assert 'watchdog: process 1 on' in out and 'is the slowest' in out, out[-3000:]
  hung = (tmp_path / 'hang' / 'process_1.txt').read_text()
  waiting = (tmp_path / 'hang' / 'process_0.txt').read_text()
  assert 'sleep_forever' in hung and 'waiting for data' in hung, hung[:2000]
  assert 'waiting for the step (a collective' in waiting, waiting[:2000]
  # Start-up to step 3 took ~5 s here; the watchdog fires 5 s after the hang (it watches only
  # after compilation: the tiny steps take ~0.1 s), then waits at most 15 s for the other
  # process's report.
  assert elapsed < 15 + seconds + 30, elapsed
  time.sleep(0.5)
  assert not _job_processes(tmp_path), 'orphan processes of the job remain'


# ----------------------------------------------------------------------------------------------
# 6. The supervisor restarts a gang that lost a process, from its last committed checkpoint.

def _kill_process_1_when(ready, overrides: dict, workdir, after_kill=lambda: None) -> str:
  """Runs a supervised 2 x 4 job of OPS (slow reads), SIGKILLs its process 1 once `ready()` (the
  OOM killer, say), calls `after_kill` (the supervisor's restart is still to come: the survivor
  gets a second of grace first) and returns the supervisor's output after the job has ended
  with status 0."""
  # --grace 1: the survivor, stuck in a collective with the killed process, cannot save
  # whatever the grace; it is SIGKILLed once the grace has passed.
  command = [sys.executable, 'launch/supervise.py', '--backoff_seconds=0.1', '--',
             *_cluster_cmd(*_train_flags(overrides, workdir, OPS), grace=1)]
  proc = subprocess.Popen(command, cwd=ROOT, env={**_env(), 'SLOW_READS': '0.1'},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 180
    while not ready():
      assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
      time.sleep(0.05)
    (victim,) = [p for p in _job_processes(workdir) if '--process_id=1' in p.cmdline()]
    victim.send_signal(signal.SIGKILL)
    after_kill()
    out, _ = proc.communicate(timeout=JOB_TIMEOUT + 60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, out[-4000:]
  return out


def test_supervisor_restarts_a_killed_job_from_the_fast_tier_and_a_peer_copy(tmp_path):
  """Checkpoints in tiers (storage/local_tier.py): the fast tier every 5 steps on each process's
  own disk, the persistent one every 50 (in this 40-step job: only at the end). Process 1 of a
  2 x 4 job is SIGKILLed at step ~33, after step 30's fast save (the OOM killer, say), and its
  fast tier is wiped (a replacement host); local_cluster stops process 0 and exits 137,
  launch/supervise.py starts the gang again, which resumes from step 30 (not 0): process 0 from
  its own files, process 1 from the copy of its shards on process 0 (fsdp over all 8 devices:
  most of process 1's shards are held by no other device). It ends with the uninterrupted run's losses and
  parameters (bitwise); metrics.jsonl and TensorBoard show each step once; events.jsonl has both
  attempts and goodput files the lost steps under the fast tier."""
  work, local, two = tmp_path / 'run', tmp_path / 'local', tmp_path / 'uninterrupted'
  split = {**BASE, 'mesh.data': 1, 'mesh.fsdp': 8, 'sharding': 'fsdp', 'fsdp_min_size': 1024,
           'checkpoint_every_steps': 50, 'num_train_steps': 40}
  steps = split['num_train_steps']
  _cluster(split, two)
  seen = []

  def ready() -> bool:  # a step logged past the fast save of step 30 on both processes
    seen.append(_last_logged_step(work))
    return seen[-1] >= 32 and all((local / f'process_{p}' / '30').is_dir() for p in (0, 1))
  overrides = {**split, 'local_checkpoint_every_steps': 5, 'local_checkpoint_dir': local}
  out = _kill_process_1_when(ready, overrides, work,
                             after_kill=lambda: shutil.rmtree(local / 'process_1'))
  logged_at_kill = seen[-1]
  assert ('supervise: attempt 1 killed by SIGKILL at committed step 0 (fast tier: step 30); '
          'restarting') in out, out[-4000:]
  assert f'[0] resumed from step 30: the fast tier in {local}' in out, out[-4000:]
  assert "[0] fast tier: process(es) [1] had no copy of step 30; their shards came from their " \
      "peers' copies" in out
  assert [r['step'] for r in _records(work, 'train')] == list(range(1, steps + 1))
  assert _losses(work) == _losses(two)  # bitwise, every step
  assert helpers.tensorboard_scalars(work, 'train/loss') == \
      helpers.tensorboard_scalars(two, 'train/loss')
  for a, b in zip(helpers.saved_params(work, steps), helpers.saved_params(two, steps)):
    np.testing.assert_array_equal(a, b)
  assert urls.committed_steps(str(work / 'checkpoints')) == [steps]  # only the last, persistent
  log = events.read(str(work))
  assert [(e['event'], e['attempt']) for e in log if e['event'] in ('start', 'exit')] == [
      ('start', 1), ('exit', 1), ('start', 2), ('exit', 2)]
  assert [(e['step'], e['tier']) for e in log if e['event'] == 'restore'] == [(30, 'local')]
  assert [e.get('step') for e in log if e['event'] == 'end' and e['attempt'] == 2] == [steps]
  # Goodput: the steps attempt 1 logged past its fast save were lost (records are fetched one
  # step late, so one more may have been trained than the test saw), filed under the fast tier;
  # the gap between the attempts is the backoff plus the next gang's start-up.
  report = goodput.report(str(work))
  first, second = report['attempts']
  assert first['first_step'] == 0 and second['first_step'] == 30 and second['last_step'] == steps
  assert second['resumed_from'] == 'local'
  assert logged_at_kill - 30 <= first['lost_steps'] <= logged_at_kill - 30 + 1, \
      (first, logged_at_kill)
  assert report['lost_steps_by_tier'] == {'local': first['lost_steps']}
  assert 'lost steps by the tier resumed from: fast' in goodput.table(report)
  (exit_1,) = [e for e in log if e['event'] == 'exit' and e['attempt'] == 1]
  assert exit_1['local_step'] == 30
  assert exit_1['restart_in'] <= report['seconds']['idle_between_attempts'] < exit_1['restart_in'] + 30
  assert report['seconds']['lost_steps'] > 0 and 0 < report['fractions']['productive'] < 1
  assert abs(sum(report['seconds'].values()) - report['wall_seconds']) < 0.05 * report['wall_seconds']
  assert not _job_processes(work), 'processes of the job remain'


def test_a_process_stopped_again_and_again_is_named_the_straggler(tmp_path):
  """Process 1 of a 2 x 4 job is SIGSTOPped for 0.4 s every 0.8 s for 8 s: the whole job slows
  down (process 0 waits for it), and only process 1 is named, in the console, events.jsonl and
  disttrain goodput."""
  overrides = {**BASE, 'num_train_steps': 100_000, 'log_every_steps': 5,
               'checkpoint_every_steps': 0}
  proc, victim = _start_cluster(overrides, tmp_path), None
  try:
    deadline = time.monotonic() + 120
    while _last_logged_step(tmp_path) < 10:  # training (compiled, both processes stepping)
      assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
      time.sleep(0.1)
    (victim,) = [p for p in _job_processes(tmp_path) if '--process_id=1' in p.cmdline()
                 and 'local_cluster' not in ' '.join(p.cmdline())]
    for _ in range(10):
      victim.suspend()
      time.sleep(0.4)
      victim.resume()
      time.sleep(0.4)
    deadline = time.monotonic() + 30
    while not [e for e in events.read(str(tmp_path)) if e['event'] == 'straggler']:
      assert proc.poll() is None and time.monotonic() < deadline, 'no straggler named'
      time.sleep(0.2)
  finally:
    if victim is not None and victim.is_running():
      victim.resume()
    if proc.poll() is None:
      proc.send_signal(signal.SIGINT)  # Ctrl-C: every process stops at an agreed step
    out = proc.communicate(timeout=120)[0]
  (named,) = [e for e in events.read(str(tmp_path)) if e['event'] == 'straggler']
  assert named['process'] == 1 and named['cause'] == 'stalled', named
  assert named['stalled_fraction'] >= 0.2, named
  assert named['others_max'] < 0.1, named
  assert 'straggler: process 1 (' in out, out[-3000:]
  report = goodput.report(str(tmp_path))
  assert [(s['process'], s['step']) for s in report['stragglers']] == [(1, named['step'])]
  assert 'straggler: attempt 1 process 1' in goodput.table(report)


def test_a_process_whose_data_is_slow_is_named_by_its_data_waits(tmp_path):
  """Slow while running: every batch read of process 1 takes 0.1 s (its storage, say) against
  steps of a few ms. Process 0 waits for it inside the step, never for its own data: process 1
  is named, by cause 'data', within the first 30 s of training, and nobody is named stalled."""
  overrides = {**BASE, 'num_train_steps': 100_000, 'log_every_steps': 5,
               'checkpoint_every_steps': 0}
  proc = _ops_cluster(tmp_path, {'SLOW_READS': '0.1', 'SLOW_PROCESS': '1'}, overrides)
  try:
    deadline = time.monotonic() + 120
    while not [e for e in events.read(str(tmp_path)) if e['event'] == 'straggler']:
      assert proc.poll() is None and time.monotonic() < deadline, 'no straggler named'
      time.sleep(0.2)
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGINT)  # Ctrl-C: every process stops at an agreed step
    out = proc.communicate(timeout=120)[0]
  named = [e for e in events.read(str(tmp_path)) if e['event'] == 'straggler']
  assert [(e['process'], e['cause']) for e in named] == [(1, 'data')], named
  assert named[0]['data_fraction'] >= 0.2 and named[0]['others_max'] < 0.1, named
  assert 'straggler: process 1 (' in out and 'waited for its data' in out, out[-3000:]


# ----------------------------------------------------------------------------------------------
# 7. A job whose workdir is a bucket (local GCS and S3 servers, tests/buckets.py) survives a
#    killed process like a local one.

@pytest.fixture(scope='module')
def servers():
  with buckets.running() as srv:
    yield srv


# s3 alone: its commit markers are disttrain's (urls.py), gs:// commits by orbax's own rules, and
# a gs:// run's resume is checked in tests/test_buckets.py.
@pytest.mark.parametrize('scheme', ['s3'])
def test_bucket_job_killed_restarts_to_the_uninterrupted_end(runs, servers, scheme):
  """Process 1 of a supervised 2 x 4 job writing to gs:// or s3:// is SIGKILLed after the
  step-10 checkpoint committed in the bucket: the gang restarts from the bucket's checkpoint and
  ends with the uninterrupted local run's losses and parameters (bitwise); keep-2 leaves exactly
  two steps in the bucket; the checkpoint restores onto 1 x 8; no client left the loopback."""
  two, _ = runs('jit')
  url = servers.bucket(scheme, f'job-{scheme}') + '/run'
  # Checkpoints at 10, 20, 30 (each save into the local S3 server took up to ~1 s): keep-2 then
  # deletes the step-10 checkpoint that attempt 1 committed in the bucket.
  overrides = {**BASE, **CASES['jit'], 'checkpoint_every_steps': 10, 'max_to_keep': 2}

  def ready() -> bool:  # the step-10 checkpoint committed in the bucket, a few steps past it
    if max(urls.committed_steps(url + '/checkpoints'), default=0) < 10:
      return False
    time.sleep(0.5)
    return True
  out = _kill_process_1_when(ready, overrides, url)
  assert 'supervise: attempt 1 killed by SIGKILL at committed step' in out, out[-4000:]
  assert '[0] resumed from step' in out
  train = helpers.metrics_records(url)
  assert [r['step'] for r in train] == list(range(1, STEPS + 1))
  assert {r['step']: r['loss'] for r in train} == _losses(two)  # bitwise, every step
  assert sorted(p.name for p in urls.path(url + '/checkpoints').iterdir()) == ['20', '30']
  for a, b in zip(helpers.saved_params(url, STEPS), helpers.saved_params(two, STEPS),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  restored = disttrain.train(_config(overrides), url)  # onto 1 x 8: nothing left to train
  assert restored.step == STEPS
  for a, b in zip(jax.tree.leaves(helpers.to_numpy(restored.state.params)),
                  helpers.saved_params(two, STEPS), strict=True):
    np.testing.assert_array_equal(a, b)
  assert [e['event'] for e in events.read(url)].count('restore') == 2
  assert not servers.hits, servers.hits

"""Bucket workdirs (gs://, s3://) against real protocol servers on 127.0.0.1 (tests/buckets.py).

Every test here ends by checking that no client tried a metadata service or a public endpoint.
The 2-process jobs killed and resumed in a bucket are in tests/test_multiprocess.py.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import disttrain
from disttrain.errors import ConfigError
from disttrain.operating import events as events_lib, goodput, metrics
from disttrain.storage import checkpoint_reads, urls
from tests import buckets, helpers
from tests.conftest import ROOT, subprocess_env

LAUNCH = [sys.executable, str(ROOT / 'launch' / 'train.py'),
          f'--config={ROOT / "launch" / "configs" / "mnist_mlp.py"}', '--fake_devices=8',
          '--config.model.hidden=64', '--config.global_batch_size=64',
          '--config.log_every_steps=1']
RUN = {'num_train_steps': 30, 'checkpoint_every_steps': 5, 'max_to_keep': 2,
       'log_every_steps': 1}


@pytest.fixture(scope='module')
def servers():
  with buckets.running() as srv:
    yield srv


@pytest.fixture(autouse=True)
def _nothing_left_loopback(servers):
  yield
  assert not servers.hits, f'a client probed outside the loopback servers: {servers.hits}'


def _env() -> dict:
  return subprocess_env()


def _launch(workdir: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
  return subprocess.Popen(LAUNCH + [f'--workdir={workdir}', *extra], env=env or _env(),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _names(url: str) -> list[str]:
  return sorted(p.name for p in urls.path(url).iterdir())


@pytest.fixture(scope='module')
def local_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('local')
  result = disttrain.train(helpers.make_config(**RUN), str(workdir))
  return workdir, result


# s3:// resumes bitwise in test_multiprocess.py::test_bucket_job_killed_restarts_to_the_
# uninterrupted_end[s3] (keep-2, restore onto 1 x 8); here gs://.
@pytest.mark.slow
@pytest.mark.parametrize('scheme', ['gs'])
def test_bucket_run_resumes_and_equals_a_local_run(servers, local_run, scheme):
  """20 steps into a bucket, then on to 30 from its checkpoint: every output is in the bucket,
  keep-2 left exactly 2 steps there, and losses, curves and parameters equal a local run's."""
  url = servers.bucket(scheme, f'equal-{scheme}') + '/runs/a'
  disttrain.train(helpers.make_config(**{**RUN, 'num_train_steps': 20}), url)
  assert urls.committed_steps(url + '/checkpoints') == [15, 20]
  result = disttrain.train(helpers.make_config(**RUN), url)
  local, expected = local_run
  assert _names(url + '/checkpoints') == ['25', '30']  # keep-N deleted the rest in the bucket
  assert {'metrics.jsonl', 'run.json', 'events.jsonl', 'checkpoints'} <= set(_names(url))
  assert any(n.startswith('events.out.tfevents') for n in _names(url))
  assert 'lease.json' not in _names(url)  # released at the end
  got = helpers.metrics_records(url)
  assert [r['step'] for r in got] == list(range(1, 31))
  assert [r['loss'] for r in got] == [r['loss'] for r in helpers.metrics_records(local)]
  for a, b in zip(helpers.saved_params(url, 30), helpers.saved_params(local, 30), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(helpers.to_numpy(result.state.params)),
                  jax.tree.leaves(helpers.to_numpy(expected.state.params)), strict=True):
    np.testing.assert_array_equal(a, b)
  events = events_lib.read(url)
  assert [e['event'] for e in events] == ['start', 'training', 'end', 'start', 'restore',
                                          'training', 'end']


@pytest.mark.slow
def test_torn_save_in_a_bucket_is_never_restored_and_a_second_run_is_refused(servers, tmp_path):
  """The step-20 save hangs in its upload (the server holds it), a second launch into the same
  bucket workdir is refused in one line while the first lives, the first is SIGKILLed mid-save,
  and the next launch takes over its lease, restores step 10 and removes the torn step 20."""
  url = servers.bucket('s3', 'torn') + '/run'
  steps = ['--config.num_train_steps=40', '--config.checkpoint_every_steps=10']
  with servers.stalled('/torn/run/checkpoints/20/') as stalled:
    first = _launch(url, *steps)
    printed = []  # its lines, read as they come (it blocks on a full pipe otherwise)
    reader = threading.Thread(target=lambda: printed.extend(first.stdout), daemon=True)
    reader.start()
    try:
      deadline = time.monotonic() + 180
      while not stalled:
        assert first.poll() is None and time.monotonic() < deadline, ''.join(printed)[-3000:]
        time.sleep(0.1)
      second = _launch(url, *steps)
      out, _ = second.communicate(timeout=180)
      assert second.returncode == 2, out[-3000:]
      (line,) = [l for l in out.splitlines() if l.startswith('error:')]
      assert f'{url} is in use by another run' in line and f'pid {first.pid}' in line, line
      assert first.poll() is None  # the first run was left alone
      # It trains on to step 30, whose save waits for the stalled one: killed there, after its
      # progress upload (every 2 s). (Killed whenever the refusal came, it had reached 20-22 on
      # a fast day: the check below then read a run that had trained less, not a lost upload.)
      while not any(l.startswith('train step 30/') for l in list(printed)):
        assert first.poll() is None and time.monotonic() < deadline, ''.join(printed)[-3000:]
        time.sleep(0.1)
      time.sleep(3)
      first.send_signal(signal.SIGKILL)
      first.wait(30)
    finally:
      if first.poll() is None:
        first.kill()
  assert urls.committed_steps(url + '/checkpoints') == [10]
  assert '20' in _names(url + '/checkpoints')  # the torn save: files, no commit marker
  # export, generate and restore_from read committed steps only (they took the torn 20).
  assert checkpoint_reads.run_config(url)[1] == 10
  third = _launch(url, '--config.num_train_steps=10', '--config.checkpoint_every_steps=10')
  out, _ = third.communicate(timeout=180)
  assert third.returncode == 0, out[-3000:]
  assert 'resumed from step 10' in out and 'nothing to train' in out
  assert _names(url + '/checkpoints') == ['10']  # the torn step 20 was cleaned up
  # The first run trained on to step 30 (whose save waits for the stalled one) while its
  # records reached the bucket only up to the step-20 checkpoint (they go every 30 s and with
  # checkpoints); progress.json, uploaded within 2 s, tells the restore and goodput how far.
  (restore,) = [e for e in events_lib.read(url) if e['event'] == 'restore']
  assert restore['step'] == 10 and 25 <= restore['trained_through'] <= 40, restore
  killed = goodput.report(url)['attempts'][0]
  assert killed['last_step'] >= 20 and killed['lost_steps'] == killed['last_step'] - 10, killed


@pytest.mark.slow
def test_a_resume_from_the_fast_tier_keeps_every_record_in_the_bucket(servers, tmp_path):
  """Records reach the bucket every 30 s and with each persistent save, not with fast-tier saves:
  killed at step 44 and resumed from the fast tier's 40, the bucket's metrics.jsonl lacked
  steps 1-40 for good (they are never trained again)."""
  url = servers.bucket('s3', 'fast') + '/run'
  command = [a if not a.startswith('--config=') else f'--config={ROOT}/tests/configs/ops.py'
             for a in LAUNCH] + [
      f'--workdir={url}', '--config.local_checkpoint_every_steps=5', '--config.eval_every_steps=0',
      f'--config.local_checkpoint_dir={tmp_path}', '--config.checkpoint_every_steps=1000']
  env = {**_env(), 'SLOW_READS': '0.2'}  # 0.2 s a step: 44 steps, well inside the 30 s
  first = subprocess.Popen(command + ['--config.num_train_steps=1000'], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for line in first.stdout:
    if line.startswith('train step 44/'):  # step 40's upload had 0.8 s
      first.send_signal(signal.SIGKILL)
      break
  first.communicate(timeout=60)
  again = subprocess.run(command + ['--config.num_train_steps=50'], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=180, check=False)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  assert f'resumed from step 40: the fast tier in {tmp_path}' in again.stdout, again.stdout
  steps = [r['step'] for r in helpers.metrics_records(url)]
  assert steps == list(range(1, 51)), steps


@pytest.mark.slow
def test_a_killed_attempts_progress_is_counted_by_the_next_attempt_only(servers):
  """An attempt that resumed and stopped before its first record left the killed attempt's
  progress.json in place: the next one counted the same lost steps again (goodput above 100%)."""
  url = servers.bucket('s3', 'progress') + '/run'
  urls.write_text(url + '/' + metrics.PROGRESS, json.dumps({'step': 40, 'time': 0}))
  for trained_through in (40, None):  # resumed from step 30 twice
    writer = metrics.Writer(url, enabled=True)
    assert writer.start(30) == trained_through
    writer.close()


@pytest.mark.slow
def test_a_corrupt_latest_step_in_a_bucket_is_moved_aside_and_the_run_resumes(servers):
  """An object store has no directory rename: the unreadable step 10 is copied under corrupt/
  and removed (a rename failed with a traceback on every relaunch), the run resumes from 5."""
  url = servers.bucket('s3', 'corrupt') + '/run'
  run = {**RUN, 'num_train_steps': 10, 'max_to_keep': 3}
  disttrain.train(helpers.make_config(**run), url, devices=jax.devices()[:1])
  urls.path(url + '/checkpoints/10/data/metadata').write_text('{')  # damaged
  result = disttrain.train(helpers.make_config(**{**run, 'num_train_steps': 12}), url,
                           devices=jax.devices()[:1])
  assert result.step == 12 and urls.committed_steps(url + '/checkpoints') == [5, 10, 12]
  (aside,) = _names(url + '/checkpoints/corrupt')
  assert aside.startswith('10-') and urls.read_text(
      f'{url}/checkpoints/corrupt/{aside}/data/metadata') == '{'
  restore = [e for e in events_lib.read(url) if e['event'] == 'restore'][-1]
  assert restore['step'] == 5, restore


@pytest.mark.slow
def test_bad_bucket_workdirs_are_one_line_and_exit_2(servers, monkeypatch):
  """A missing bucket (either scheme), missing S3 credentials, an unknown scheme, a URL with
  no bucket and a missing extra: one line each naming the problem and the fix."""
  cases = [('s3://no-such-bucket/run', {}, "cannot write to s3://no-such-bucket/run (bucket "
            "'no-such-bucket')"),
           ('gs://no-such-bucket/run', {}, "cannot write to gs://no-such-bucket/run (bucket "
            "'no-such-bucket')"),
           (servers.bucket('s3', 'nocreds') + '/run',
            {'AWS_ACCESS_KEY_ID': None, 'AWS_SECRET_ACCESS_KEY': None},
            'AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY'),
           ('hdfs://cluster/run', {}, 'storage URLs must be gs://BUCKET/PATH or s3://BUCKET/PATH'),
           ('s3:///run', {}, 'names no bucket; pass s3://BUCKET/PATH')]
  for url, change, said in cases:
    env = _env()
    for k, v in change.items():
      env.pop(k) if v is None else env.__setitem__(k, v)
    proc = _launch(url, '--config.num_train_steps=2', env=env)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, (url, out[-3000:])
    errors = [l for l in out.splitlines() if l.startswith('error:')]
    assert len(errors) == 1 and said in errors[0], (url, out[-3000:])
    assert 'Traceback' not in out, out[-3000:]
  monkeypatch.setitem(sys.modules, 's3fs', None)
  with pytest.raises(ConfigError, match=r"needs s3fs, which is not installed; pip install "
                                         r"'disttrain\[s3\]'"):
    urls.resolve('s3://bucket/run')


def test_bucket_urls_that_would_not_store_where_they_read_are_refused():
  """'#' and '?' (tensorstore: a fragment and a query; every step's arrays landed in one place
  outside the run), '..', spaces, and a one-slash typo (a local directory 's3:' was trained in)."""
  for url, said in [('gs://b/r#1', "a '#' or '?'"), ('s3://b/r?x=1', "a '#' or '?'"),
                    ('s3://b/../escape', "a '..' segment"), ('s3://b/run /x', 'trailing space'),
                    ('s3://b/run ', 'leading or trailing space; remove it'),
                    ('s3:/b/run', 'one slash; pass s3://BUCKET/PATH, or ./s3:/b/run'),
                    ('GS:/b/run', 'one slash; pass gs://BUCKET/PATH')]:
    with pytest.raises(ConfigError, match=re.escape(said)):
      urls.resolve(url)
  assert urls.resolve('gs://b/ok/run.1/') == 'gs://b/ok/run.1'


@pytest.mark.slow
def test_a_hugging_face_save_streams_into_a_bucket_and_loads_in_transformers(servers, tmp_path):
  """saves.write (hf_save_every_steps, disttrain export) to s3://, files split in two with an
  index: downloaded as they are, transformers loads them and its logits equal ours."""
  import flax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from disttrain.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from disttrain.hf import saves  # pylint: disable=g-import-not-at-top
  from disttrain.models.decoder import Decoder  # pylint: disable=g-import-not-at-top
  from disttrain.models import llama  # pylint: disable=g-import-not-at-top
  cfg = helpers.make_config(**{'model.name': 'llama', 'model.hidden': 32, 'model.num_heads': 4,
                               'model.num_kv_heads': 2, 'model.mlp_dim': 64,
                               'model.vocab_size': 260})
  model = llama.build(cfg.model, 'float32', 32)
  params = flax.linen.unbox(model.module.init(jax.random.key(0), np.zeros((1, 8), np.int32)))
  params = params['params']
  url = servers.bucket('s3', 'hf-save') + '/run/hf/7'
  files, size, _ = saves.write(url, 'llama', cfg.model, model.cfg, params,
                               tokenizer_lib.load(''), 32, max_shard_bytes=60_000)
  assert len(files) == 2 and size > 0
  local = tmp_path / 'hf'
  local.mkdir()
  for name in _names(url):
    (local / name).write_bytes(urls.path(f'{url}/{name}').read_bytes())
  assert 'model.safetensors.index.json' in os.listdir(local)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
  tokens = np.arange(3, 19, dtype=np.int32)[None]
  with torch.no_grad():
    want = theirs(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = np.asarray(Decoder(model.cfg).apply({'params': params}, tokens, False))[..., :260]
  np.testing.assert_allclose(ours, want, atol=1e-5)

"""What a feature of the loop costs in training throughput, as a ratio measured in one process.

  python benchmarks/loop_cost.py --feature=checkpoint [--every=100] [--steps=600]
  python benchmarks/loop_cost.py --feature=profile    # a 3-step profiler window at step 200
  python benchmarks/loop_cost.py --feature=callbacks  # EarlyStopping + a record-reading callback
  python benchmarks/loop_cost.py --feature=bucket     # checkpoints to a local S3 server vs a dir

Runs the whole disttrain loop (grain data, metrics, evals off) on the seed-004 MLP, batch 128, on
synthetic MNIST-shaped data, alternating runs with the feature and runs without, and reports the
median train throughput of each and their ratio. Throughput is taken from the loop's own train
records (which exclude compilation, evals and saves' waits), without the first window (start-up)
and the last; for the profiler, also without the window that holds the traced steps, so the
ratio says what the steps outside the trace pay. Also reports each run's trace count (1 = every
step variant compiled once). --feature=bucket runs three kinds, interleaved: no checkpoints,
checkpoints every --every steps to a local directory, and the whole workdir on an S3 server
(moto, its own process on 127.0.0.1, in memory), and reports both ratios against none.
"""

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from absl import app, flags, logging

_FEATURE = flags.DEFINE_enum('feature', 'checkpoint', ['checkpoint', 'profile', 'callbacks',
                                                          'bucket'],
                             'What the measured runs add.')
_FAKE_DEVICES = flags.DEFINE_integer('fake_devices', 1, 'CPU devices.')
_STEPS = flags.DEFINE_integer('steps', 600, 'Train steps per run.')
_EVERY = flags.DEFINE_integer('every', 100, 'checkpoint / bucket: checkpoint_every_steps.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Runs of each kind, interleaved.')
_JSON = flags.DEFINE_string('json', None, 'Write the result here.')
_LOG_EVERY = 50
_PROFILE_START = 200


class _ReadsRecords:
  """A callback that reads every record it is given (and keeps nothing)."""

  def __init__(self):
    self.seen = 0

  def on_train_record(self, record):
    self.seen += record['step'] > 0

  def on_eval(self, record):
    self.seen += 1


@contextlib.contextmanager
def _s3_server():
  """A moto S3 server in its own process (its CPU is the transfer's, as a real store's would be
  elsewhere); its settings in this process's environment; yields a bucket URL."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  server = subprocess.Popen([sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p',
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f'http://127.0.0.1:{port}'
  os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID='bench', AWS_SECRET_ACCESS_KEY='bench',
                    AWS_DEFAULT_REGION='us-east-1', AWS_EC2_METADATA_DISABLED='true')
  try:
    for _ in range(100):
      try:
        urllib.request.urlopen(urllib.request.Request(f'{url}/bench', method='PUT'))
        break
      except OSError:
        time.sleep(0.1)
    yield 's3://bench', server.pid
  finally:
    server.terminate()
    server.wait()


def _throughput(with_feature: bool, bucket: str = '', blocked: list | None = None
                ) -> tuple[float, int]:
  import disttrain  # pylint: disable=g-import-not-at-top
  cd = disttrain.defaults()
  cd.data.name = 'synthetic'
  cd.global_batch_size = 128
  cd.num_train_steps = _STEPS.value
  cd.log_every_steps = _LOG_EVERY
  callbacks = []
  if with_feature and _FEATURE.value in ('checkpoint', 'bucket'):
    cd.checkpoint_every_steps = _EVERY.value
  if with_feature and _FEATURE.value == 'profile':
    cd.profile.start_step, cd.profile.num_steps = _PROFILE_START, 3
  if with_feature and _FEATURE.value == 'callbacks':
    callbacks = [disttrain.EarlyStopping('eval/accuracy', patience=100), _ReadsRecords()]
  with tempfile.TemporaryDirectory() as workdir:
    if bucket:  # a new run in the bucket each time, as the local runs get a new directory
      workdir = f'{bucket}/{os.path.basename(workdir)}'
    result = disttrain.train(disttrain.from_config_dict(cd), workdir, callbacks=callbacks)
  if blocked is not None:  # seconds the loop waited for saves (their synchronous part)
    blocked.append(result.time['checkpoint']['seconds'])
  records = [r for r in result.records if r['split'] == 'train'][1:-1]
  if _FEATURE.value == 'profile':  # the record whose window holds the traced steps
    records = [r for r in records
               if not r['step'] - _LOG_EVERY < _PROFILE_START + 2 <= r['step'] + 1]
  rates = [r['examples_per_sec'] for r in records]
  # Every window has the same number of steps: total examples / total time = harmonic mean.
  return len(rates) / sum(1 / r for r in rates), result.trace_count


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', _FAKE_DEVICES.value)
  with_feature, without, in_bucket, traces = [], [], [], set()
  blocked = {'local': [], 'bucket': []}
  server_cpu = []
  serve = _s3_server() if _FEATURE.value == 'bucket' else contextlib.nullcontext(('', None))
  with serve as (bucket, server_pid):
    for _ in range(_REPEATS.value):
      rate, count = _throughput(False)
      without.append(rate)
      traces.add(count)
      rate, count = _throughput(True, blocked=blocked['local'])
      with_feature.append(rate)
      traces.add(count)
      if bucket:
        import psutil  # pylint: disable=g-import-not-at-top
        before = sum(psutil.Process(server_pid).cpu_times()[:2])
        rate, count = _throughput(True, bucket, blocked=blocked['bucket'])
        server_cpu.append(sum(psutil.Process(server_pid).cpu_times()[:2]) - before)
        in_bucket.append(rate)
        traces.add(count)
  result = {'feature': _FEATURE.value, 'devices': _FAKE_DEVICES.value, 'steps': _STEPS.value,
            'examples_per_sec_with': statistics.median(with_feature),
            'examples_per_sec_without': statistics.median(without), 'trace_counts': sorted(traces)}
  if _FEATURE.value in ('checkpoint', 'bucket'):
    result['every'] = _EVERY.value
  result['ratio'] = result['examples_per_sec_with'] / result['examples_per_sec_without']
  if in_bucket:
    result['examples_per_sec_bucket'] = statistics.median(in_bucket)
    result['ratio_bucket'] = result['examples_per_sec_bucket'] / result['examples_per_sec_without']
    result['checkpoint_blocking_seconds'] = {k: statistics.median(v) for k, v in blocked.items()}
    result['server_cpu_seconds_per_run'] = statistics.median(server_cpu)
  what = {'checkpoint': f'checkpoint every {_EVERY.value} steps',
          'profile': 'a 3-step profiler window (steps outside it)',
          'callbacks': 'EarlyStopping + a record-reading callback',
          'bucket': f'checkpoint every {_EVERY.value} steps to a local directory'}[_FEATURE.value]
  print(f'{what}: {result["examples_per_sec_with"]:,.0f} examples/s vs '
        f'{result["examples_per_sec_without"]:,.0f} without: ratio {result["ratio"]:.3f} '
        f'(cost {100 * (1 - result["ratio"]):.1f}%); trace counts {sorted(traces)}')
  if in_bucket:
    print(f'the workdir on a local S3 server, checkpoint every {_EVERY.value} steps: '
          f'{result["examples_per_sec_bucket"]:,.0f} examples/s: ratio '
          f'{result["ratio_bucket"]:.3f} (cost {100 * (1 - result["ratio_bucket"]):.1f}%); the loop '
          f'waited for saves {result["checkpoint_blocking_seconds"]["bucket"]:.2f} s per run (local '
          f'{result["checkpoint_blocking_seconds"]["local"]:.2f} s); the S3 server used '
          f'{result["server_cpu_seconds_per_run"]:.2f} CPU s per run on the same cores')
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  sys.path.insert(0, __file__.rsplit('/benchmarks/', 1)[0])
  logging.set_verbosity(logging.WARNING)
  app.run(main)

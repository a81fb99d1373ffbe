"""What a feature of the loop costs in training throughput, as a ratio measured in one process.

  python benchmarks/loop_cost.py --feature=checkpoint [--every=100] [--steps=600]
  python benchmarks/loop_cost.py --feature=profile    # a 3-step profiler window at step 200
  python benchmarks/loop_cost.py --feature=callbacks  # EarlyStopping + a record-reading callback
  python benchmarks/loop_cost.py --feature=bucket     # checkpoints to a local S3 server vs a dir
  python benchmarks/loop_cost.py --feature=local_tier [--every=10]  # the fast checkpoint tier

Runs the whole disttrain loop (grain data, metrics, evals off) on the seed-004 MLP, batch 128, on
synthetic MNIST-shaped data, alternating runs with the feature and runs without, and reports the
median train throughput of each and their ratio. Throughput is taken from the loop's own train
records (which exclude compilation, evals and saves' waits), without the first window (start-up)
and the last; for the profiler, also without the window that holds the traced steps, so the
ratio says what the steps outside the trace pay. Also reports each run's trace count (1 = every
step variant compiled once). --feature=bucket runs three kinds, interleaved: no checkpoints,
checkpoints every --every steps to a local directory, and the whole workdir on an S3 server
(moto, its own process on 127.0.0.1, in memory), and reports both ratios against none; also
each kind's wall and CPU seconds per run, and the same saves outside the loop (the transfer
itself). --server_cpus=1 runs the server on CPU 1 and training on the others, as a real store
runs elsewhere: then the bucket's extra wall time splits into the client's CPU and waits.
--feature=local_tier saves the fast tier (storage/local_tier.py) every --every steps into the
run's temporary directory; one process, so without the peer copy's reshard.
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
                                                          'bucket', 'local_tier'],
                             'What the measured runs add.')
_FAKE_DEVICES = flags.DEFINE_integer('fake_devices', 1, 'CPU devices.')
_STEPS = flags.DEFINE_integer('steps', 600, 'Train steps per run.')
_EVERY = flags.DEFINE_integer('every', 100, 'checkpoint / bucket: checkpoint_every_steps; '
                              'local_tier: local_checkpoint_every_steps.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Runs of each kind, interleaved.')
_JSON = flags.DEFINE_string('json', None, 'Write the result here.')
_SERVER_CPUS = flags.DEFINE_list(
    'server_cpus', [], 'bucket: run the S3 server on these CPUs and training on the others, as a '
    'real store runs on other machines (default: both share every CPU).')
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
  server_cpus = {int(c) for c in _SERVER_CPUS.value}
  server = subprocess.Popen([sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p',
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=(lambda: os.sched_setaffinity(0, server_cpus))
                            if server_cpus else None)
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
  import psutil  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as workdir:
    if bucket:  # a new run in the bucket each time, as the local runs get a new directory
      workdir = f'{bucket}/{os.path.basename(workdir)}'
    if with_feature and _FEATURE.value == 'local_tier':
      cd.local_checkpoint_every_steps = _EVERY.value
      cd.local_checkpoint_dir = os.path.join(workdir, 'fast')
    wall, cpu = time.perf_counter(), sum(psutil.Process().cpu_times()[:2])
    result = disttrain.train(disttrain.from_config_dict(cd), workdir, callbacks=callbacks)
    wall, cpu = time.perf_counter() - wall, sum(psutil.Process().cpu_times()[:2]) - cpu
  if bucket:
    _LAST_STATE[:] = [result.state]
  if blocked is not None:  # seconds the loop waited for saves (their synchronous part)
    blocked.append({'wait': result.time['checkpoint']['seconds'], 'wall': wall, 'cpu': cpu})
  records = [r for r in result.records if r['split'] == 'train'][1:-1]
  if _FEATURE.value == 'profile':  # the records whose windows hold a traced step
    traced = range(_PROFILE_START, _PROFILE_START + 3)
    records = [r for r in records
               if not any(r['step'] - _LOG_EVERY < s <= r['step'] for s in traced)]
  rates = [r['examples_per_sec'] for r in records]
  # Every window has the same number of steps: total examples / total time = harmonic mean.
  return len(rates) / sum(1 / r for r in rates), result.trace_count


_LAST_STATE = []  # a bucket run's final state: what the transfer-alone measurement saves


def _transfer_alone(bucket: str) -> dict:
  """Wall and CPU seconds of this process to save (and commit) the run's state as often as a run
  does, outside any loop: the transfer itself, to the bucket and to a local directory."""
  import disttrain  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  from disttrain.storage import checkpoint  # pylint: disable=g-import-not-at-top
  cfg = disttrain.from_config_dict(disttrain.defaults())
  seconds = {}
  with tempfile.TemporaryDirectory() as local:
    for kind, where in (('local', local), ('bucket', f'{bucket}/transfer-alone')):
      ckpt = checkpoint.Checkpointer(where, cfg)
      wall, cpu = time.perf_counter(), sum(psutil.Process().cpu_times()[:2])
      for step in range(_EVERY.value, _STEPS.value + 1, _EVERY.value):
        ckpt.save(step, _LAST_STATE[0], {}, {})
        ckpt.wait()
      ckpt.close()
      seconds[kind] = {'wall': time.perf_counter() - wall,
                       'cpu': sum(psutil.Process().cpu_times()[:2]) - cpu}
  return seconds


def main(argv):
  del argv
  if _SERVER_CPUS.value:  # before jax starts its thread pools
    os.sched_setaffinity(0, os.sched_getaffinity(0) - {int(c) for c in _SERVER_CPUS.value})
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
    alone = _transfer_alone(bucket) if bucket else None
  result = {'feature': _FEATURE.value, 'devices': _FAKE_DEVICES.value, 'steps': _STEPS.value,
            'examples_per_sec_with': statistics.median(with_feature),
            'examples_per_sec_without': statistics.median(without), 'trace_counts': sorted(traces)}
  if _FEATURE.value in ('checkpoint', 'bucket', 'local_tier'):
    result['every'] = _EVERY.value
    result['checkpoint_blocking_seconds_with'] = statistics.median(
        r['wait'] for r in blocked['local'])
  result['ratio'] = result['examples_per_sec_with'] / result['examples_per_sec_without']
  if in_bucket:
    result['examples_per_sec_bucket'] = statistics.median(in_bucket)
    result['ratio_bucket'] = result['examples_per_sec_bucket'] / result['examples_per_sec_without']
    # Per run: the loop's waits for saves, the run's wall time and its process's CPU time (all
    # threads: steps, the upload clients); with training on one CPU, wall - CPU = time idle.
    result['checkpoint_blocking_seconds'] = {
        k: statistics.median(r['wait'] for r in v) for k, v in blocked.items()}
    result['run_seconds'] = {k: {m: statistics.median(r[m] for r in v) for m in ('wall', 'cpu')}
                             for k, v in blocked.items()}
    result['server_cpu_seconds_per_run'] = statistics.median(server_cpu)
  what = {'checkpoint': f'checkpoint every {_EVERY.value} steps',
          'profile': 'a 3-step profiler window (steps outside it)',
          'callbacks': 'EarlyStopping + a record-reading callback',
          'bucket': f'checkpoint every {_EVERY.value} steps to a local directory',
          'local_tier': f'the fast tier every {_EVERY.value} steps'}[_FEATURE.value]
  print(f'{what}: {result["examples_per_sec_with"]:,.0f} examples/s vs '
        f'{result["examples_per_sec_without"]:,.0f} without: ratio {result["ratio"]:.3f} '
        f'(cost {100 * (1 - result["ratio"]):.1f}%); trace counts {sorted(traces)}')
  if in_bucket:
    print(f'the workdir on a local S3 server, checkpoint every {_EVERY.value} steps: '
          f'{result["examples_per_sec_bucket"]:,.0f} examples/s: ratio '
          f'{result["ratio_bucket"]:.3f} (cost {100 * (1 - result["ratio_bucket"]):.1f}%); the loop '
          f'waited for saves {result["checkpoint_blocking_seconds"]["bucket"]:.2f} s per run (local '
          f'{result["checkpoint_blocking_seconds"]["local"]:.2f} s); the S3 server used '
          f'{result["server_cpu_seconds_per_run"]:.2f} CPU s per run '
          + (f'on CPUs {",".join(_SERVER_CPUS.value)} (training on the others)'
             if _SERVER_CPUS.value else 'on the same cores'))
  if in_bucket:
    runs = result['run_seconds']
    print('per run, wall / CPU of the training process: ' + ', '.join(
        f'{k} {v["wall"]:.2f} / {v["cpu"]:.2f} s' for k, v in runs.items()) +
          f'; the bucket run took {runs["bucket"]["wall"] - runs["local"]["wall"]:+.2f} s wall '
          f'and {runs["bucket"]["cpu"] - runs["local"]["cpu"]:+.2f} s CPU more')
    result['transfer_alone_seconds'] = alone
    print(f'the same saves outside the loop (the transfer itself), wall / CPU: bucket '
          f'{alone["bucket"]["wall"]:.2f} / {alone["bucket"]["cpu"]:.2f} s, local '
          f'{alone["local"]["wall"]:.2f} / {alone["local"]["cpu"]:.2f} s: '
          f'{alone["bucket"]["cpu"] - alone["local"]["cpu"]:+.2f} s CPU in the bucket')
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  sys.path.insert(0, __file__.rsplit('/benchmarks/', 1)[0])
  logging.set_verbosity(logging.WARNING)
  app.run(main)

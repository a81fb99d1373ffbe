"""The first checkpoint of a multi-device run: small replicated arrays written whole vs in slices.

  python benchmarks/checkpoint_save.py [--fake_devices=8] [--repeats=3]

orbax writes a replicated array as one slice per replica and compiles a slice program per
(shape, device) at a process's first save; disttrain writes an array whole from one replica when
its per-replica slice is under storage.checkpoint.MIN_REPLICA_SLICE_BYTES. Each measurement is a
fresh process (the compiles happen once per process) that builds the default run's state (the
seed-004 MLP: 38 arrays of 4 B to 1 MiB, replicated) and times its first save until committed,
with disttrain's threshold and with orbax's own (0: always sliced), alternated; prints the
medians and their ratio.
"""

import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

_DEVICES = flags.DEFINE_integer('fake_devices', 8, 'CPU devices.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Processes per setting.')

_ONE = """
import json, sys, tempfile, time
import jax
jax.config.update('jax_num_cpu_devices', {devices})
import disttrain
from disttrain.storage import checkpoint
checkpoint.MIN_REPLICA_SLICE_BYTES = {threshold}
cfg = disttrain.defaults()
cfg.mesh.data = {devices}
run = disttrain.setup(disttrain.from_config_dict(cfg))
ckpt = checkpoint.Checkpointer(tempfile.mkdtemp(), run.cfg)
state = run.steps.export(run.state)
jax.block_until_ready(state)
start = time.perf_counter()
ckpt.save(1, state, {{}}, {{}})
ckpt.wait()
print(json.dumps(time.perf_counter() - start))
"""


def _seconds(threshold: int) -> float:
  code = _ONE.format(devices=_DEVICES.value, threshold=threshold)
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}  # the device count is ours
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                       env={**env, 'JAX_PLATFORMS': 'cpu'})
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  from disttrain.storage import checkpoint  # pylint: disable=g-import-not-at-top
  whole, sliced = [], []
  for _ in range(_REPEATS.value):
    whole.append(_seconds(checkpoint.MIN_REPLICA_SLICE_BYTES))
    sliced.append(_seconds(0))
  result = {'devices': _DEVICES.value,
            'first_save_sec': round(statistics.median(whole), 3),
            'first_save_sec_sliced': round(statistics.median(sliced), 3)}
  result['ratio'] = round(result['first_save_sec_sliced'] / result['first_save_sec'], 1)
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)

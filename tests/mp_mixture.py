"""One process of a 2-process job that reads a staged mixture with 2 workers (test helper).

  python launch/local_cluster.py --program=tests/mp_mixture.py --num_processes=2 \
      --devices_per_process=4 -- --out=DIR

Reads STEPS_BEFORE global batches of mixture() on all 8 devices and writes, from process 0,
DIR/mixture.json: the global batches (gathered over the processes) and the iterator state after
them, which tests/test_mixture.py resumes in one process.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import mp_job  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH, STEPS_BEFORE, STEPS = 16, 6, 12
# A stage boundary before the resume point and one after it.
STAGES = ((4, {'a': 0.2, 'b': 0.8}), (9, {'a': 0.5, 'b': 0.5}))


def mixture():
  """Two in-memory sources whose rows say where they come from: x = 1000 source + index."""
  from disttrain.data.mixture import Mixture  # pylint: disable=g-import-not-at-top
  rows = lambda source, n: {'x': np.repeat(1000 * source + np.arange(n, dtype=np.int32)[:, None],
                                           4, axis=1)}
  return Mixture({'a': rows(0, 100), 'b': rows(1, 37)}, {'a': 0.7, 'b': 0.3}, STAGES)


def main():
  args = mp_job.join()

  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from disttrain import config as config_lib  # pylint: disable=g-import-not-at-top
  from disttrain.data.batches import TrainIterator  # pylint: disable=g-import-not-at-top
  from disttrain.data.mixture import MixtureRecords  # pylint: disable=g-import-not-at-top
  from disttrain.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  sharding = mesh_lib.batch_sharding(mesh_lib.build(config_lib.MeshConfig(data=-1),
                                                    jax.devices()))
  batches = TrainIterator(MixtureRecords(mixture(), BATCH, 0), BATCH, 0, sharding, workers=2)
  seen = [multihost_utils.process_allgather(next(batches)['x'], tiled=True)[:, 0].tolist()
          for _ in range(STEPS_BEFORE)]
  state = batches.get_state()
  batches.close()
  if jax.process_index() == 0:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'mixture.json'), 'w', encoding='utf-8') as f:
      json.dump({'batches': seen, 'state': state}, f)
  print(f'process {jax.process_index()}: read {STEPS_BEFORE} mixture batches')


if __name__ == '__main__':
  main()

"""One process of a multi-process job that records which example ids it reads (test helper).

  python launch/local_cluster.py --program=tests/mp_ids.py --num_processes=2 \
      --devices_per_process=4 -- --out=DIR

Per layout (natural and interleaved device orders, with and without a replicated tensor axis)
it reads two epochs of TrainIterator and one pass of eval_batches, checks every device's rows
against the global batch of a 1-device iterator in the same process, and writes
DIR/ids_<process>.json for tests/test_multiprocess.py to take the union over processes.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import mp_job  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH = 64
EVAL_EXAMPLES = 325  # digits: 1797 - 325 = 1472 = 23 x 64 train (no remainder); 325 = 5 x 64 + 5
EPOCHS = 2


class _RecordingSource:
  """A random-access source over arrays that logs the indices of every batched read: exactly
  the examples this process reads (grain's reader thread reads one batch per call)."""

  def __init__(self, arrays: dict):
    self.arrays, self.reads = arrays, []

  def __len__(self) -> int:
    return len(self.arrays['label'])

  def __getitem__(self, index: int) -> dict:
    self.reads.append([int(index)])
    return {k: v[index] for k, v in self.arrays.items()}

  def __getitems__(self, indices: list) -> list:
    self.reads.append([int(i) for i in indices])
    return [{k: v[i] for k, v in self.arrays.items()} for i in indices]


def _held(array) -> dict[tuple[int, int], np.ndarray]:
  """(start, stop) -> rows of `array` on this process's devices, one entry per distinct block."""
  blocks = {}
  for shard in array.addressable_shards:
    start, stop, _ = shard.index[0].indices(array.shape[0])
    blocks[(start, stop)] = np.asarray(shard.data)
  return blocks


def _layouts(jax, mesh_lib, config_lib):
  """name -> (mesh config, device order)."""
  per_process = [[d for d in jax.devices() if d.process_index == p]
                 for p in range(jax.process_count())]
  natural = [d for devices in per_process for d in devices]
  interleaved = [d for group in zip(*per_process) for d in group]
  return {
      'natural_data8': (config_lib.MeshConfig(data=-1), natural),
      'interleaved_data8': (config_lib.MeshConfig(data=-1), interleaved),
      'natural_data2_fsdp2_tensor2': (config_lib.MeshConfig(data=2, fsdp=2, tensor=2), natural),
  }


def main():
  args = mp_job.join()

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from disttrain import config as config_lib  # pylint: disable=g-import-not-at-top
  from disttrain import data  # pylint: disable=g-import-not-at-top
  from disttrain.data import sources  # pylint: disable=g-import-not-at-top
  from disttrain.data.records import ID, MASK, Records  # pylint: disable=g-import-not-at-top
  from disttrain.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  cd = config_lib.defaults()
  cd.data.eval_examples = EVAL_EXAMPLES
  digits = sources.build(config_lib.from_config_dict(cd))
  train = Records(digits['train_data'], 'train', 0)
  held_out = Records(digits['eval_data'], 'eval', 0)
  steps = EPOCHS * len(train) // BATCH
  # The reference: the same stream on one local device, i.e. the whole global batch.
  one_device = mesh_lib.batch_sharding(mesh_lib.build(config_lib.MeshConfig(data=1),
                                                  jax.local_devices()[:1]))
  reference = data.TrainIterator(train, BATCH, 0, one_device)
  reference_ids = [np.asarray(next(reference)[ID]) for _ in range(steps)]
  reference.close()

  report = {'process': jax.process_index(), 'train_examples': len(train),
            'eval_examples': len(held_out), 'batch': BATCH, 'steps': steps, 'layouts': {}}
  for name, (mesh_cfg, devices) in _layouts(jax, mesh_lib, config_lib).items():
    sharding = mesh_lib.batch_sharding(mesh_lib.build(mesh_cfg, devices))
    rows = data.local_rows(sharding, BATCH)
    source = _RecordingSource(digits['train_data'])
    reads = source.reads
    batches = data.TrainIterator(Records(source, 'train', 0), BATCH, 0, sharding)
    held_ids = []
    for k in range(steps):
      batch = next(batches)
      blocks = _held(batch[ID])
      for (start, stop), ids in blocks.items():
        # Each device holds exactly its rows of the global batch, whatever the device order.
        np.testing.assert_array_equal(ids, reference_ids[k][start:stop], err_msg=f'{name} {k}')
      held = np.concatenate([blocks[b] for b in sorted(blocks)])
      held_ids.append(held.tolist())
    batches.close()
    # Reads happen in grain's single reader thread, in batch order (it may read ahead); the
    # first read is example 0, for the element spec.
    read_ids = reads[1:steps + 1]
    # A global reduction over the processes' data: every step sees the whole global batch.
    total = jax.jit(jnp.sum)(batch[ID].astype(jnp.float32))

    eval_ids, eval_batches, eval_count = [], 0, 0.0
    for batch in data.eval_batches(held_out, BATCH, sharding):
      eval_batches += 1
      blocks = _held(batch[ID])
      masks = _held(batch[MASK])
      for block, ids in blocks.items():
        eval_ids += ids[masks[block] > 0].tolist()
      eval_count += float(jax.jit(jnp.sum)(batch[MASK]))  # collective: the global count
    report['layouts'][name] = {
        'local_rows': rows.tolist(), 'read_ids': read_ids, 'held_ids': held_ids,
        'last_batch_id_sum': float(total), 'last_reference_id_sum': float(reference_ids[-1].sum()),
        'eval_ids': eval_ids, 'eval_batches': eval_batches, 'eval_count': eval_count}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f'ids_{jax.process_index()}.json'), 'w',
            encoding='utf-8') as f:
    json.dump(report, f)
  print(f'process {jax.process_index()}: wrote ids for {len(report["layouts"])} layouts')


if __name__ == '__main__':
  main()

"""The input pipeline alone: memory while streaming a large ArrayRecord set, and what workers buy.

  python benchmarks/input_pipeline.py [--gib=2.0] [--dir=PATH] [--json=out.json]

1. Memory: writes (or reuses, in --dir) an ArrayRecord data set of --gib GiB of 64x64x3 uint8
   images, streams every example once through disttrain's TrainIterator with data.workers=2 on
   one device, and reports the process's peak RSS growth against the data set's size. Nothing
   may load the set whole (target: growth < 25 % of the size).
2. Workers: the same pipeline with a CPU-heavy transform (~1-2 ms of single-threaded numpy per
   example) at workers=0 and workers=2, alternating, in this run: examples/s of each and their
   ratio (target on 2 cores: >= 1.6).
"""

import json
import os
import resource
import sys
import tempfile
import time

from absl import app, flags
import grain
import numpy as np

_GIB = flags.DEFINE_float('gib', 2.0, 'Size of the streamed data set on disk, GiB.')
_DIR = flags.DEFINE_string('dir', '', 'Keep the data set here (reused if present); default: a '
                           'temporary folder, removed at the end.')
_BATCH = flags.DEFINE_integer('batch', 64, 'Global batch size.')
_HEAVY_BATCHES = flags.DEFINE_integer('heavy_batches', 40, 'Batches per timed window of part 2.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed windows per worker count in part 2.')
_JSON = flags.DEFINE_string('json', None, 'Write the results here.')

SHAPE = (64, 64, 3)  # 12 KiB per example
_HEAVY_ROUNDS = 50  # rounds of elementwise numpy in the heavy transform


class Decode(grain.transforms.Map):
  """Encoded record -> {'image': float32 in [0, 1], 'label'} (cheap)."""

  def map(self, example):
    return {'image': example['image'].astype(np.float32) / 255, 'label': example['label']}


class Heavy(grain.transforms.RandomMap):
  """~1-2 ms of elementwise numpy per example (one core: numpy's elementwise ops do not thread)."""

  def random_map(self, example, rng):
    x = example['image'] + rng.normal(0, 0.01, size=SHAPE).astype(np.float32)
    for _ in range(_HEAVY_ROUNDS):
      x = np.tanh(x * 1.5) + np.sin(x) * 0.25
    return {**example, 'image': x}


def _rss_mib() -> float:
  """Peak resident set of this process so far (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write(folder: str, examples: int) -> list[str]:
  from disttrain.data import formats  # pylint: disable=g-import-not-at-top
  paths = formats.shard_paths(os.path.join(folder, 'train'), 8)
  if all(os.path.exists(p) for p in paths):
    return paths
  rng = np.random.default_rng(0)

  def generate():
    for i in range(examples):
      yield {'image': rng.integers(0, 256, SHAPE, np.uint8), 'label': np.int32(i % 10)}
  # Random pixels do not compress: store them as they are.
  return formats.write_array_record(os.path.join(folder, 'train'), generate(), num_shards=8,
                                    num_examples=examples, options='group_size:1,uncompressed')


def _iterator(source, workers: int, transforms):
  import jax  # pylint: disable=g-import-not-at-top
  from disttrain import data  # pylint: disable=g-import-not-at-top
  from disttrain.data.records import Data, Records  # pylint: disable=g-import-not-at-top
  from disttrain.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from disttrain.config import MeshConfig  # pylint: disable=g-import-not-at-top
  mesh = mesh_lib.build(MeshConfig(data=1), jax.devices()[:1])
  return data.TrainIterator(Records(Data(source, transforms), 'train', 0), _BATCH.value, 0,
                            mesh_lib.batch_sharding(mesh), prefetch=2, workers=workers)


def memory(folder: str) -> dict:
  """Part 1: peak RSS growth while streaming every example once with 2 workers."""
  import jax  # pylint: disable=g-import-not-at-top
  from disttrain.data import formats  # pylint: disable=g-import-not-at-top
  examples = int(_GIB.value * 2**30 // (np.prod(SHAPE) + 64))
  start = time.perf_counter()
  paths = _write(folder, examples)
  write_sec = time.perf_counter() - start
  size = sum(os.path.getsize(p) for p in paths)
  source = formats.array_record_source(paths)
  rss_before = _rss_mib()
  it = _iterator(source, 2, [Decode()])
  batches = len(source) // _BATCH.value
  start = time.perf_counter()
  for _ in range(batches):
    jax.block_until_ready(next(it))
  seconds = time.perf_counter() - start
  it.close()
  rss_after = _rss_mib()
  children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
  growth = rss_after - rss_before
  return {'dataset_bytes': size, 'dataset_gib': round(size / 2**30, 3), 'examples': len(source),
          'write_sec': round(write_sec, 1), 'stream_sec': round(seconds, 1),
          'stream_mib_per_sec': round(size / 2**20 / seconds, 1),
          'peak_rss_before_mib': round(rss_before, 1), 'peak_rss_after_mib': round(rss_after, 1),
          'peak_rss_growth_mib': round(growth, 1),
          'growth_fraction_of_dataset': round(growth * 2**20 / size, 4),
          'largest_worker_peak_rss_mib': round(children, 1)}


def workers(folder: str) -> dict:
  """Part 2: examples/s with the heavy transform at 0 and 2 workers, alternating windows."""
  import jax  # pylint: disable=g-import-not-at-top
  from disttrain.data import formats  # pylint: disable=g-import-not-at-top
  source = formats.array_record_source(formats.shard_paths(os.path.join(folder, 'train'), 8))
  example = Heavy().random_map(Decode().map(source[0]), np.random.default_rng(0))
  start = time.perf_counter()
  for i in range(50):
    Heavy().random_map(Decode().map(source[i]), np.random.default_rng(i))
  per_example_ms = (time.perf_counter() - start) / 50 * 1e3
  del example
  rates = {0: [], 2: []}
  for _ in range(_REPEATS.value):
    for n in (0, 2):
      it = _iterator(source, n, [Decode(), Heavy()])
      for _ in range(2 * n + 1):  # start-up is not timed: every worker has delivered once
        jax.block_until_ready(next(it))
      start = time.perf_counter()
      for _ in range(_HEAVY_BATCHES.value):
        jax.block_until_ready(next(it))
      rates[n].append(_HEAVY_BATCHES.value * _BATCH.value / (time.perf_counter() - start))
      it.close()
  med = {n: float(np.median(r)) for n, r in rates.items()}
  return {'transform_ms_per_example': round(per_example_ms, 2),
          'examples_per_sec_workers0': round(med[0], 1),
          'examples_per_sec_workers2': round(med[2], 1),
          'ratio_workers2_to_workers0': round(med[2] / med[0], 3), 'cpus': os.cpu_count()}


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')
  folder = _DIR.value
  tmp = None
  if not folder:
    tmp = tempfile.TemporaryDirectory(prefix='input_pipeline_')
    folder = tmp.name
  os.makedirs(folder, exist_ok=True)
  result = {'memory': memory(folder), 'workers': workers(folder)}
  m, w = result['memory'], result['workers']
  print(f'memory: streamed {m["dataset_gib"]:.2f} GiB ({m["examples"]:,} examples) with 2 workers '
        f'in {m["stream_sec"]}s ({m["stream_mib_per_sec"]} MiB/s); peak RSS '
        f'{m["peak_rss_before_mib"]}'
        f' -> {m["peak_rss_after_mib"]} MiB: grew {m["peak_rss_growth_mib"]} MiB = '
        f'{100 * m["growth_fraction_of_dataset"]:.1f}% of the data set (target < 25%)')
  print(f'workers: heavy transform {w["transform_ms_per_example"]} ms/example: '
        f'{w["examples_per_sec_workers0"]:,.0f} examples/s at workers=0, '
        f'{w["examples_per_sec_workers2"]:,.0f} at workers=2: ratio '
        f'{w["ratio_workers2_to_workers0"]:.2f} on {w["cpus"]} CPUs (target >= 1.6)')
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=2)
  if tmp is not None:
    tmp.cleanup()


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)

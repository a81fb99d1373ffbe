"""What periodic async checkpoints cost the training loop, as a ratio measured in one process.

  python benchmarks/checkpoint_cost.py [--fake_devices=1] [--steps=600] [--every=100] [--repeats=3]

Runs the whole disttrain loop (grain data, metrics, evals off) on the seed-004 MLP, batch 128, on
synthetic MNIST-shaped data, alternating runs that save every --every steps with runs that save
only at the end, and reports the median train throughput of each and their ratio. Throughput is
taken from the loop's own train records, excluding the first window (compilation) and the last
(the final save), so that both sides time the same steady-state steps.
"""

import json
import statistics
import sys
import tempfile

from absl import app, flags

_FAKE_DEVICES = flags.DEFINE_integer('fake_devices', 1, 'CPU devices.')
_STEPS = flags.DEFINE_integer('steps', 600, 'Train steps per run.')
_EVERY = flags.DEFINE_integer('every', 100, 'checkpoint_every_steps of the checkpointing runs.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Runs of each kind, interleaved.')
_JSON = flags.DEFINE_string('json', None, 'Write the result here.')


def _throughput(with_checkpoints: bool) -> float:
  import disttrain  # pylint: disable=g-import-not-at-top
  cd = disttrain.defaults()
  cd.data.name = 'synthetic'
  cd.global_batch_size = 128
  cd.num_train_steps = _STEPS.value
  cd.log_every_steps = 50
  cd.checkpoint_every_steps = _EVERY.value if with_checkpoints else 0
  with tempfile.TemporaryDirectory() as workdir:
    result = disttrain.train(disttrain.from_config_dict(cd), workdir)
  rates = [r['examples_per_sec'] for r in result.records if r['split'] == 'train'][1:-1]
  # Every window has the same number of steps: total examples / total time = harmonic mean.
  return len(rates) / sum(1 / r for r in rates)


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', _FAKE_DEVICES.value)
  with_ckpt, without = [], []
  for _ in range(_REPEATS.value):
    without.append(_throughput(False))
    with_ckpt.append(_throughput(True))
  result = {'devices': _FAKE_DEVICES.value, 'steps': _STEPS.value, 'every': _EVERY.value,
            'examples_per_sec_checkpointing': statistics.median(with_ckpt),
            'examples_per_sec_baseline': statistics.median(without)}
  result['ratio'] = result['examples_per_sec_checkpointing'] / result['examples_per_sec_baseline']
  print(f'checkpoint every {_EVERY.value} steps: {result["examples_per_sec_checkpointing"]:,.0f} '
        f'examples/s vs {result["examples_per_sec_baseline"]:,.0f} without: ratio '
        f'{result["ratio"]:.3f} (cost {100 * (1 - result["ratio"]):.1f}%)')
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  sys.path.insert(0, __file__.rsplit('/benchmarks/', 1)[0])
  app.run(main)

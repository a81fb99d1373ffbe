"""GPipe's bubble, measured: a pipelined step against the same step without stages.

  taskset -c 0 python benchmarks/bubble.py [--stages=4] [--micro_batches=4,8,16] [--json=PATH]

Fake CPU devices share the host's cores, so a stage waiting for its input does not show as idle
time: it computes on zeros that nothing reads (disttrain/models/pipeline.py). Pinned to one core,
every device's work is serialized, and the pipelined step (S stages of L / S layers on S
devices, M + S - 1 iterations) does (M + S - 1) / M of the work of the same model on 1 device
accumulating the M micro-batches one after another. So 1 - t(1 device) / t(S stages) measures
the bubble, (S - 1) / (M + S - 1) if nothing else differs. What else differs, and is counted
here as bubble: the embedding and the logits run on every stage's devices, and the hand-offs.
The model is the Llama config's with 8 layers of width 256 (byte vocabulary), so the layers
dominate; the micro-batch is 4 rows of 128 tokens whatever M.
"""

import json
import os
import sys
import time

from absl import app, flags

_STAGES = flags.DEFINE_integer('stages', 4, 'mesh.stage of the pipelined side.')
_MICRO = flags.DEFINE_list('micro_batches', ['4', '8', '16'], 'M of each row.')
_WINDOWS = flags.DEFINE_integer('windows', 5, 'Timed steps per side, interleaved.')
_JSON = flags.DEFINE_string('json', None, 'Write the rows here.')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _side(stages: int, m: int):
  """(step, state, batch) of the Llama at the benchmark's size with M micro-batches."""
  import jax  # pylint: disable=g-import-not-at-top
  import runpy  # pylint: disable=g-import-not-at-top
  import disttrain  # pylint: disable=g-import-not-at-top
  from disttrain import data  # pylint: disable=g-import-not-at-top
  from disttrain.parallel.step import Variant  # pylint: disable=g-import-not-at-top
  cd = runpy.run_path(os.path.join(_ROOT, 'launch', 'configs', 'llama.py'))['get_config']('tiny')
  cd.model.num_layers, cd.model.hidden, cd.model.mlp_dim = 8, 256, 768
  cd.global_batch_size, cd.grad_accum_steps = 4 * m, m
  cd.data.text.bytes, cd.eval_every_steps = 300_000, 0
  cd.mesh.data, cd.mesh.stage = 1, stages
  cfg = disttrain.from_config_dict(cd)
  run = disttrain.setup(cfg, devices=jax.devices()[:stages])
  it = data.TrainIterator(run.train_data, cfg.global_batch_size, cfg.seed, run.batch_sharding)
  batch = next(it)
  it.close()
  step = run.steps.make_train(Variant(metrics=False, full_batch=True))
  state = run.steps.place(run.state)
  state, _ = step(state, batch)  # compile and warm up
  jax.block_until_ready(state)
  return step, state, batch


def _time(side) -> tuple[float, object]:
  import jax  # pylint: disable=g-import-not-at-top
  step, state, batch = side
  start = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return time.perf_counter() - start, (step, state, batch)


def _direct(stages: int, m: int):
  """(step, args) of value_and_grad through disttrain/models/pipeline.py alone on S devices:
  8 residual tanh-MLP layers (256 -> 1,024 -> 256), micro-batches of 4 x 128 tokens."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from disttrain.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from disttrain.config import MeshConfig  # pylint: disable=g-import-not-at-top
  from disttrain.models import pipeline  # pylint: disable=g-import-not-at-top
  parallel = mesh_lib.Parallelism.from_config(MeshConfig(data=1, stage=stages),
                                              jax.devices()[:stages])
  keys = jax.random.split(jax.random.key(0), 3)
  params = {'w1': jax.random.normal(keys[0], (8, 256, 1024)) * 0.03,
            'w2': jax.random.normal(keys[1], (8, 1024, 256)) * 0.03}
  x = jax.random.normal(keys[2], (4 * m, 128, 256))
  layer = lambda p, h: h + jnp.tanh(h @ p['w1']) @ p['w2']

  def loss(params, x):
    out = pipeline.run(layer, params, x, (), parallel.mesh, parallel.stage_axis,
                       parallel.batch_axes, m)
    return jnp.mean(out ** 2)
  step = jax.jit(jax.value_and_grad(loss))
  jax.block_until_ready(step(params, x))
  return step, (params, x)


def _time_direct(side) -> tuple[float, object]:
  import jax  # pylint: disable=g-import-not-at-top
  step, args = side
  start = time.perf_counter()
  jax.block_until_ready(step(*args))
  return time.perf_counter() - start, side


def rows() -> list[dict]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from disttrain.models import pipeline  # pylint: disable=g-import-not-at-top
  s, out = _STAGES.value, []
  for what, make, time_ in (('pipeline.run alone, S = 1 vs S', _direct, _time_direct),
                            ('llama step, 1 device accumulating vs S stages', _side, _time)):
    for m in (int(v) for v in _MICRO.value):
      sides = {'one': make(1, m), 'staged': make(s, m)}
      secs = {'one': [], 'staged': []}
      for _ in range(_WINDOWS.value):
        for name in sides:
          t, sides[name] = time_(sides[name])
          secs[name].append(t)
      one, staged = float(np.median(secs['one'])), float(np.median(secs['staged']))
      out.append({'what': what, 'stages': s, 'micro_batches': m, 'one_device_s': round(one, 4),
                  'staged_s': round(staged, 4), 'measured_bubble': round(1 - one / staged, 4),
                  'gpipe_bubble': round(pipeline.bubble_fraction(s, m), 4)})
      print(json.dumps(out[-1]), flush=True)
  return out


def main(argv):
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', max(8, _STAGES.value))
  results = rows()
  print('| what | S | M | 1 s/step | S s/step | measured bubble | (S - 1) / (M + S - 1) |')
  print('| --- | --- | --- | --- | --- | --- | --- |')
  for r in results:
    print(f"| {r['what']} | {r['stages']} | {r['micro_batches']} | {r['one_device_s']:.3f} | "
          f"{r['staged_s']:.3f} | {r['measured_bubble']:.3f} | {r['gpipe_bubble']:.3f} |")
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump({'results': results}, f, indent=2)


if __name__ == '__main__':
  sys.path.insert(0, _ROOT)
  app.run(main)

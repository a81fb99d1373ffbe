"""Downstream evaluation speed: the loop's batched evaluator against one request at a time.

  python benchmarks/downstream.py [--fake_devices=8] [--size=tiny] [--questions=64]
      [--choices=4] [--eval_batch=32] [--repeats=3] [--json=F]

One run is set up (training/setup.py) for launch/configs/llama.py at --size on mesh.data = every
device, with data.eval_tasks naming a multiple-choice file of --questions generated questions.
Both sides score the same tokenized requests with the same sharded parameters:
  batched     evaluation.Downstream, as the loop calls it: [eval_batch, T] batches, T bucketed,
              rows split over the batch axes, one batch fetched while the next runs
  one_by_one  a jitted forward of one request at a time ([1, T], T bucketed as the batched side
              does, inputs replicated), its log-likelihood fetched before the next is sent
Every shape of both sides is compiled by a first pass that is not timed; each side then scores
the task --repeats times and the median is reported, as questions (examples) per second.
"""

import json
import os
import runpy
import statistics
import sys
import tempfile
import time

from absl import app, flags

_FAKE = flags.DEFINE_integer('fake_devices', 8, 'CPU devices (0: the real devices).')
_SIZE = flags.DEFINE_string('size', 'tiny', 'A size of launch/configs/llama.py.')
_QUESTIONS = flags.DEFINE_integer('questions', 64, 'Multiple-choice questions in the task.')
_CHOICES = flags.DEFINE_integer('choices', 4, 'Choices per question.')
_BATCH = flags.DEFINE_integer('eval_batch', 32, 'eval_batch_size: rows per batched call.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed passes over the task per side.')
_JSON = flags.DEFINE_string('json', None, 'Write the result here.')

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _task(path: str) -> None:
  """Questions over byte text: contexts of 20-80 characters, choices of 1-30."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz     '))
  text = lambda n: ''.join(rng.choice(letters, n)).strip() or 'x'
  with open(path, 'w', encoding='utf-8') as f:
    for _ in range(_QUESTIONS.value):
      choices = [text(int(rng.integers(1, 31))) for _ in range(_CHOICES.value)]
      f.write(json.dumps({'context': text(int(rng.integers(20, 81))), 'choices': choices,
                          'answer': int(rng.integers(_CHOICES.value))}) + '\n')


def _one_by_one(run, requests):
  """Scores each request alone: (score(), the distinct shapes it compiles for)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from disttrain.evaluation import scoring  # pylint: disable=g-import-not-at-top
  module = run.downstream.scorer.module
  replicated = NamedSharding(run.mesh, P())

  @jax.jit
  def one(params, tokens_1xN, targets_1xN):
    logp = jax.nn.log_softmax(module.apply({'params': params}, tokens_1xN, False), axis=-1)
    counted = targets_1xN >= 0
    picked = jnp.take_along_axis(logp, jnp.maximum(targets_1xN, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(counted, picked, 0.0).sum()

  rows = []
  for context, continuation in requests:
    ids = (list(context) + list(continuation))[-(run.downstream.max_len + 1):]
    t = scoring.bucket(len(ids) - 1, run.downstream.max_len)  # a few shapes, as batched has
    tokens, targets = np.zeros((1, t), np.int32), np.full((1, t), -1, np.int32)
    tokens[0, :len(ids) - 1] = ids[:-1]
    targets[0, len(ids) - 1 - len(continuation):len(ids) - 1] = continuation
    rows.append((tokens, targets))

  def score(params):
    return [float(one(params, jax.device_put(t, replicated), jax.device_put(g, replicated)))
            for t, g in rows]
  return score, len({t.shape[1] for t, _ in rows})


def main(argv) -> None:
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  import jax  # pylint: disable=g-import-not-at-top
  if _FAKE.value:
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', _FAKE.value)
  import disttrain  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as setup_lib  # pylint: disable=g-import-not-at-top
  scratch = tempfile.mkdtemp(prefix='disttrain-downstream-')
  path = os.path.join(scratch, 'mc.jsonl')
  _task(path)
  cd = runpy.run_path(os.path.join(_ROOT, 'launch', 'configs', 'llama.py'))['get_config'](
      _SIZE.value)
  cd.mesh.data, cd.eval_batch_size = jax.device_count(), _BATCH.value
  cd.data.text.bytes, cd.data.eval_examples, cd.data.eval_tasks = 20_000, 8, f'mc={path}'
  run = setup_lib.setup(disttrain.from_config_dict(cd))
  evaluate = lambda: run.downstream(run.state, say=lambda line: None)
  requests = [r for question in run.downstream.inputs['mc'] for r in question]
  one_by_one, lengths = _one_by_one(run, requests)
  timings = {}
  for name, side in (('batched', evaluate), ('one_by_one', lambda: one_by_one(run.state.params))):
    start = time.perf_counter()
    side()  # compiles every shape this side uses
    warm = time.perf_counter() - start
    seconds = []
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      side()
      seconds.append(time.perf_counter() - start)
    timings[name] = (statistics.median(seconds), warm)
  batched = _QUESTIONS.value / timings['batched'][0]
  single = _QUESTIONS.value / timings['one_by_one'][0]
  result = {'devices': jax.device_count(), 'platform': jax.devices()[0].platform,
            'size': _SIZE.value, 'questions': _QUESTIONS.value, 'requests': len(requests),
            'eval_batch': run.downstream.scorer.rows, 'one_by_one_shapes': lengths,
            'batched_examples_per_sec': batched, 'one_by_one_examples_per_sec': single,
            'ratio': batched / single,
            'first_pass_sec': {k: v[1] for k, v in timings.items()}}
  print(f'{result["questions"]} questions ({len(requests)} requests), {result["devices"]} '
        f'{result["platform"]} devices, llama {_SIZE.value}: batched {batched:,.1f} examples/s '
        f'(B={result["eval_batch"]}), one by one {single:,.1f} examples/s ({lengths} shapes '
        f'compiled); ratio {result["ratio"]:.1f}x (compile excluded)', flush=True)
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  app.run(main)

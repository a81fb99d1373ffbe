"""Post-training against full fine-tuning of the same model, batch and devices, in one process.

  python benchmarks/post_training.py [--fake_devices=8] [--json=out.json]
  python benchmarks/post_training.py --grpo [--fake_devices=8]     # GRPO's sampling vs learning
  python benchmarks/post_training.py --grpo_loss                    # GRPO's chunked loss

LoRA (lora.rank=16 on every attention and MLP projection, base in float32 and in bfloat16)
against training every weight, on a Llama of 8 x 512 (mlp 1,536, 25 M parameters), batch
16 x 256 tokens, AdamW: the per-device state bytes (parameters, optimizer state, frozen base) and
temporaries of the compiled step (XLA's memory analysis), and the step time as the median of
paired ratios (full, LoRA, full, LoRA, ... one step each, after a warm-up), since this machine's
speed drifts between minutes. LoRA's step skips the frozen weights' gradients (a third of the
matmul FLOPs) and their optimizer update.

--grpo: a GRPO run of the llama recipe's tiny size (4 x 128) on launch/data/sums.jsonl's
prompts, 8 prompts x 8 completions of up to 16 and 64 tokens a step (a constant reward: the
model stays as initialised, so completions end only at a rare EOS), and the records' split of each step between sampling (the KV-cache decoder on the
training mesh) and learning (the update), with tokens/s for each: medians over the steps after
the first record (which holds the compilations).

--grpo_loss: GRPO's loss and its gradients on chunked features (a decoder's last hidden states
and unembedding, disttrain/models/chunked_loss.py): 4 rows of 512 tokens, width 512, Qwen's
151,936 ids in chunks of 128 tokens; each chunk's gradients made while its logits exist (fused)
against the backward pass remaking them (remade): XLA's FLOP count of the compiled value and
gradient, its temporaries, and the median of paired time ratios (fused, remade, ...).
"""

import json
import os
import sys
import time

from absl import app, flags

import recipes

_JSON = flags.DEFINE_string('json', None, 'Write the rows here.')
_FAKE_DEVICES = flags.DEFINE_integer('fake_devices', 1, 'CPU devices (data x fsdp when > 1).')
_PAIRS = flags.DEFINE_integer('pairs', 7, 'Timed (full, LoRA) step pairs.')
_GRPO = flags.DEFINE_bool('grpo', False, "GRPO's sampling and learning rows instead.")
_GRPO_LOSS = flags.DEFINE_bool('grpo_loss', False, "GRPO's chunked loss, fused against remade.")
_MODEL = {'model.num_layers': 8, 'model.hidden': 512, 'model.num_heads': 8,
          'model.num_kv_heads': 4, 'model.mlp_dim': 1536, 'data.seq_len': 256,
          'global_batch_size': 16, 'data.text.bytes': 400_000, 'warmup_steps': 0}
_SETTINGS = (('full fine-tuning', {}),
             ('LoRA r=16, float32 base', {'lora.rank': 16}),
             ('LoRA r=16, bfloat16 base', {'lora.rank': 16, 'lora.base_dtype': 'bfloat16'}))


def rows(n: int, pairs: int) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import disttrain  # pylint: disable=g-import-not-at-top
  from disttrain import data  # pylint: disable=g-import-not-at-top
  from disttrain.parallel.step import Variant  # pylint: disable=g-import-not-at-top
  from disttrain.training import memory, setup as run_lib  # pylint: disable=g-import-not-at-top
  mesh = ({'mesh.data': 1} if n == 1 else {'mesh.data': 2} if n < 4 else
          {'mesh.data': 2, 'mesh.fsdp': n // 2, 'sharding': 'fsdp'})
  out, runs = [], []
  for name, overrides in _SETTINGS:
    cfg = recipes.config('llama', 'tiny', {**_MODEL, **mesh, **overrides})
    run = disttrain.setup(cfg, devices=jax.devices()[:n])
    it = data.TrainIterator(run.train_data, run.cfg.global_batch_size, 0, run.batch_sharding)
    batch = next(it)
    it.close()
    parts = run_lib.run_info(run)['state_bytes_per_device_by_part']
    trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(run.state.params))
    state = run.steps.place(run.state)
    variant = Variant(metrics=False, full_batch=True)
    info = run.steps.compile(variant, state, memory.train_batch_spec(run))
    out.append({'setting': name, 'devices': n, 'trainable_params': trainable, **parts,
                'temp_bytes': info.temp_bytes, 'peak_bytes': info.peak_bytes})
    runs.append((run, state, batch, variant))

  def step(i: int) -> float:
    run, state, batch, variant = runs[i]
    start = time.perf_counter()
    state, metrics = run.steps.train(state, batch, variant)
    jax.block_until_ready(metrics)
    runs[i] = (run, state, batch, variant)
    return time.perf_counter() - start

  for i in range(len(runs)):  # warm-up
    step(i)
  times = [[step(i) for i in range(len(runs))] for _ in range(pairs)]
  for i, row in enumerate(out):
    row['step_seconds'] = round(float(np.median([t[i] for t in times])), 4)
    row['step_time_vs_full'] = round(float(np.median([t[i] / t[0] for t in times])), 3)
  return out


def grpo_rows(n: int, steps: int = 24) -> list[dict]:
  import tempfile  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import disttrain  # pylint: disable=g-import-not-at-top
  sums = os.path.join(os.path.dirname(recipes.CONFIGS), 'data', 'sums.jsonl')
  mesh = {'mesh.data': 1} if n == 1 else {'mesh.data': n}
  out = []
  for new in (16, 64):
    cfg = recipes.config('llama', 'tiny', {
        'data.name': 'prompts', 'data.train_files': sums, 'data.seq_len': 16,
        'grpo.group_size': 8, 'grpo.max_new_tokens': new, 'global_batch_size': 64,
        'model.vocab_size': 257, 'num_train_steps': steps, 'log_every_steps': 1,
        'eval_every_steps': 0, 'warmup_steps': 0, **mesh})
    never_ends = lambda prompts, completions, **_: [0.0] * len(completions)
    with tempfile.TemporaryDirectory() as workdir:
      result = disttrain.train(cfg, workdir, devices=jax.devices()[:n], rewards=[never_ends])
    records = [r for r in result.records if r['split'] == 'train'][1:]
    median = lambda k: float(np.median([r[k] for r in records if k in r]))
    out.append({'setting': f'GRPO, 64 completions of <= {new} tokens after 16', 'devices': n,
                'sample_tokens_per_sec': round(median('sample_tokens_per_sec')),
                'learn_tokens_per_sec': round(median('learn_tokens_per_sec')),
                'sample_fraction': round(median('sample_fraction'), 3),
                'completion_length': median('completion_length')})
  return out


def grpo_loss_rows(pairs: int) -> list[dict]:
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from disttrain.models import chunked_loss, grpo  # pylint: disable=g-import-not-at-top
  b, t, d, v, c = 4, 512, 512, 151_936, 128
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(b, t, d)) * 0.1, jnp.float32)
  u = jnp.asarray(rng.normal(size=(d, v)) * 0.02, jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  rows = {'advantages': jnp.asarray(rng.normal(size=b), jnp.float32)}
  task = grpo.Grpo(temperature=0.7)

  def loss(h, u, fused):
    features = chunked_loss.Features(h, u, v, False, c, jnp.float32)
    sums, _ = chunked_loss.token_sums(features, targets, jnp.ones((b, t)), task._token_terms,  # pylint: disable=protected-access
                                      {}, rows, task.temperature, fused)
    return sums.sum() / (b * t)  # a token mean, as the step's
  compiled, out = {}, []
  for fused in (True, False):
    compiled[fused] = jax.jit(jax.value_and_grad(functools.partial(loss, fused=fused),
                                                 (0, 1))).lower(h, u).compile()
    jax.block_until_ready(compiled[fused](h, u))  # warm-up
  seconds = {True: [], False: []}
  for _ in range(pairs):
    for fused in (True, False):
      start = time.perf_counter()
      jax.block_until_ready(compiled[fused](h, u))
      seconds[fused].append(time.perf_counter() - start)
  for fused in (True, False):
    cost = compiled[fused].cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out.append({'setting': f'GRPO loss, {"fused" if fused else "remade"}', 'gflop':
                round(cost['flops'] / 1e9, 1), 'temp_mib': round(
                    compiled[fused].memory_analysis().temp_size_in_bytes / 2**20, 1),
                'seconds': round(float(np.median(seconds[fused])), 3),
                'time_vs_remade': round(float(np.median(np.divide(seconds[fused],
                                                                  seconds[False]))), 3)})
  return out


def main(argv) -> None:
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  if _FAKE_DEVICES.value > 1:
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_'
                               f'device_count={_FAKE_DEVICES.value}')
  if _GRPO_LOSS.value:
    result = grpo_loss_rows(_PAIRS.value)
  else:
    result = (grpo_rows if _GRPO.value else rows)(_FAKE_DEVICES.value, *(
        () if _GRPO.value else (_PAIRS.value,)))
  for row in result:
    print(json.dumps(row), flush=True)
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  app.run(main)

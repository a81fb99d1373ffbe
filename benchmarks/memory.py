"""Per-device memory of train steps from XLA's compiled memory analysis: nothing is run.

  python benchmarks/memory.py [--json=out.json]

1. The GPT config's default size (launch/configs/gpt.py: 4 x 128, batch 32 x 128 tokens) on one
   device, where activations dominate: float32, grad_accum_steps=4, model.remat=full, bf16.
   `kept` is what the forward pass keeps for the backward pass
   (training.memory.saved_activation_bytes): XLA:CPU computes bf16 dots in float32, so its temp
   bytes cannot show what bf16 saves.
2. GPT-2 small (124 M parameters, batch 16 x 1,024 tokens) over 8 fake CPU devices, fsdp=8 and
   data 2 x fsdp 2 x tensor 2: compile seconds, and state bytes per device against the total
   divided by the ways the parameters are split.
3. Long context: the tiny Llama (launch/configs/llama.py: 4 x 128, GQA 4/2 heads) on one
   sequence of T = 16,384 tokens per step (a batch data parallelism cannot split), on 1 device
   and with mesh.context=8: temporaries per device and per token, and the longest T (doubling
   from 4,096) whose step fits --limit_mib per device with and without the split.
4. Mixture of experts: the tiny Llama with 8 experts (2 per token) per layer, batch 32 x 128, on
   1 device and with mesh.expert=8: state bytes per device, and the experts' share of them.
5. Pipeline stages: GPT-2 small (12 layers, batch 16 x 1,024, 4 micro-batches) on S = 1, 2, 4
   devices with mesh.stage=S: state and temporaries per device (S = 1 accumulates the 4
   micro-batches one after another; GPipe holds every micro-batch's activations).
6. Large vocabularies: the tiny Llama with Gemma's 262,144 ids on one row of T = 2,048 tokens, the
   cross-entropy whole (model.loss_chunk=-1) and chunked (0, auto: 32 chunks of 64 tokens): the
   logits, not the model, fill the temporaries (disttrain/models/chunked_loss.py).

  python benchmarks/memory.py --accelerator [--json=out.json]

compiles GPT-2 small (batch 32 x 1,024 tokens) for this host's first GPU or TPU instead: float32,
bf16 with XLA's attention, bf16 with the default (cuDNN's fused kernel on a GPU), and bf16 with
remat=full: what an accelerator's bf16 dots and fused attention save, which XLA:CPU cannot show.
"""

import json
import os
import sys

from absl import app, flags

import recipes

_JSON = flags.DEFINE_string('json', None, 'Write the rows here.')
_ACCELERATOR = flags.DEFINE_bool('accelerator', False, 'GPT-2 small on this host\'s first '
                                  'accelerator instead of the rows above on CPU.')
_LIMIT_MIB = flags.DEFINE_integer('limit_mib', 1024, 'Long context: the per-device limit.')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every row but remat=full keeps every activation (model.remat=none), as before the CPU default
# became dots_saveable (auto), so the rows stay comparable.
_NONE = {'model.remat': 'none'}
_SMALL = (('float32', _NONE), ('grad_accum_steps=4', {'grad_accum_steps': 4, **_NONE}),
          ('model.remat=full', {'model.remat': 'full'}),
          ('bfloat16', {'precision.compute_dtype': 'bfloat16', **_NONE}),
          ('bfloat16, remat=full', {'precision.compute_dtype': 'bfloat16', 'model.remat': 'full'}))
_ON_ACCELERATOR = (('float32', {}),
                   ('bfloat16, attention=xla', {'precision.compute_dtype': 'bfloat16',
                                                'model.attention': 'xla'}),
                   ('bfloat16', {'precision.compute_dtype': 'bfloat16'}),
                   ('bfloat16, remat=full', {'precision.compute_dtype': 'bfloat16',
                                             'model.remat': 'full'}))
_LONG = 16_384
_CONTEXT = (('1 device', {'mesh.data': 1}, 1), ('context=8', {'mesh.data': 1, 'mesh.context': 8}, 8))
_GPT2_MESHES = (('fsdp=8', {'mesh.data': 1, 'mesh.fsdp': 8}, 8),
                ('data 2 x fsdp 2 x tensor 2', {'mesh.data': 2, 'mesh.fsdp': 2,
                                                'mesh.tensor': 2}, 4))


def _config(size: str, overrides: dict, name: str = 'gpt'):
  return recipes.config(name, size, overrides)


def rows() -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import disttrain  # pylint: disable=g-import-not-at-top
  from disttrain.training import memory, setup as run_lib  # pylint: disable=g-import-not-at-top
  from disttrain.data.records import ID  # pylint: disable=g-import-not-at-top
  from disttrain.parallel.step import Variant  # pylint: disable=g-import-not-at-top
  out = []
  for name, overrides in _SMALL:
    cfg = _config('small', {'mesh.data': 1, 'data.text.bytes': 100_000, **overrides})
    run = disttrain.setup(cfg, devices=jax.devices()[:1])
    info = run.steps.compile(Variant(full_batch=True), run.state, memory.train_batch_spec(run))
    out.append({'model': 'gpt small, 1 device', 'setting': name, **info.to_json(),
                'kept_for_backward_bytes': memory.saved_activation_bytes(run)})
  window = jax.ShapeDtypeStruct((1, 1024), np.int32)
  spec = {'tokens': window, 'targets': window, ID: jax.ShapeDtypeStruct((1,), np.int32)}
  for name, mesh, ways in _GPT2_MESHES:
    plan = run_lib.plan(_config('gpt2_small', {'global_batch_size': 16, **mesh}), spec,
                        jax.devices())
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(plan.state))
    info = plan.compile()
    out.append({'model': 'gpt2_small, 8 devices', 'setting': name, **info.to_json(),
                'state_total_bytes': total, 'split_ways': ways,
                'state_vs_even_split': round(info.state_bytes / (total / ways), 3)})
  return out + _long_context_rows() + _moe_rows() + _pipeline_rows() + _vocab_rows()


def _vocab_rows() -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as run_lib  # pylint: disable=g-import-not-at-top
  from disttrain.data.records import ID  # pylint: disable=g-import-not-at-top
  window = jax.ShapeDtypeStruct((1, 2048), np.int32)
  spec = {'tokens': window, 'targets': window, ID: jax.ShapeDtypeStruct((1,), np.int32)}
  out = []
  for name, chunk in (('loss_chunk=-1 (whole)', -1), ('loss_chunk=0 (auto)', 0)):
    cfg = _config('tiny', {'global_batch_size': 1, 'data.seq_len': 2048, 'mesh.data': 1,
                           'model.vocab_size': 262_144, 'model.loss_chunk': chunk}, 'llama')
    plan = run_lib.plan(cfg, spec, jax.devices()[:1])
    out.append({'model': 'llama tiny, V = 262,144, 1 x 2,048', 'setting': name,
                **plan.compile().to_json()})
  return out


def _pipeline_rows() -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as run_lib  # pylint: disable=g-import-not-at-top
  from disttrain.data.records import ID  # pylint: disable=g-import-not-at-top
  window = jax.ShapeDtypeStruct((1, 1024), np.int32)
  spec = {'tokens': window, 'targets': window, ID: jax.ShapeDtypeStruct((1,), np.int32)}
  out = []
  for s in (1, 2, 4):
    cfg = _config('gpt2_small', {'global_batch_size': 16, 'grad_accum_steps': 4,
                                 'mesh.data': 1, 'mesh.stage': s})
    plan = run_lib.plan(cfg, spec, jax.devices()[:s])
    out.append({'model': 'gpt2_small, batch 16 x 1,024, M = 4', 'setting': f'stage={s}',
                **plan.compile().to_json()})
  return out


def accelerator_rows() -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as run_lib  # pylint: disable=g-import-not-at-top
  from disttrain.data.records import ID  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  window = jax.ShapeDtypeStruct((1, 1024), np.int32)
  spec = {'tokens': window, 'targets': window, ID: jax.ShapeDtypeStruct((1,), np.int32)}
  out = []
  for name, overrides in _ON_ACCELERATOR:
    plan = run_lib.plan(_config('gpt2_small', {'mesh.data': 1, **overrides}), spec, [device])
    out.append({'model': f'gpt2_small, batch 32, {device.device_kind}', 'setting': name,
                **plan.compile().to_json()})
  return out


def _moe_rows() -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as run_lib  # pylint: disable=g-import-not-at-top
  from disttrain.data.records import ID  # pylint: disable=g-import-not-at-top
  window = jax.ShapeDtypeStruct((1, 128), np.int32)
  spec = {'tokens': window, 'targets': window, ID: jax.ShapeDtypeStruct((1,), np.int32)}
  out = []
  for name, mesh, n in (('1 device', {'mesh.data': 1}, 1),
                        ('expert=8', {'mesh.data': 1, 'mesh.expert': 8}, 8)):
    cfg = _config('tiny', {'global_batch_size': 32, 'data.seq_len': 128, 'model.num_experts': 8,
                           'model.experts_per_token': 2, **mesh}, 'llama')
    plan = run_lib.plan(cfg, spec, jax.devices()[:n])
    params = plan.state.params
    experts = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                  for x in jax.tree.leaves(params['blocks']['moe']) if x.ndim == 4)
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(plan.state))
    info = plan.compile()
    out.append({'model': 'llama tiny, 8 experts (k = 2)', 'setting': name, **info.to_json(),
                'state_total_bytes': total, 'expert_param_bytes': experts})
  return out


def _long_step(t: int, mesh: dict, n: int):
  """The compiled train step of the tiny Llama on one sequence of t tokens, over n devices."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as run_lib  # pylint: disable=g-import-not-at-top
  from disttrain.data.records import ID  # pylint: disable=g-import-not-at-top
  window = jax.ShapeDtypeStruct((1, t), np.int32)
  spec = {'tokens': window, 'targets': window, ID: jax.ShapeDtypeStruct((1,), np.int32)}
  cfg = _config('tiny', {'global_batch_size': 1, 'data.seq_len': t, **mesh}, 'llama')
  return run_lib.plan(cfg, spec, jax.devices()[:n]).compile()


def _long_context_rows() -> list[dict]:
  out = []
  for name, mesh, n in _CONTEXT:
    info = _long_step(_LONG, mesh, n)
    longest, t = 0, 4096
    while t <= 2**20:  # doubling until the step no longer fits the limit
      if _long_step(t, mesh, n).peak_bytes > _LIMIT_MIB.value * 2**20:
        break
      longest, t = t, 2 * t
    out.append({'model': f'llama tiny, T = {_LONG:,}', 'setting': name, **info.to_json(),
                'temp_bytes_per_token': info.temp_bytes / _LONG,
                'longest_t_within_limit': longest, 'limit_mib': _LIMIT_MIB.value})
  return out


def _mib(n: float) -> str:
  return f'{n / 2**20:,.1f}'


def table(results: list[dict]) -> str:
  lines = ['| model | setting | compile s | state MiB | temp MiB | peak MiB | kept for backward '
           'MiB | state / (total / ways) |', '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for r in results:
    kept = _mib(r['kept_for_backward_bytes']) if 'kept_for_backward_bytes' in r else ''
    split = f'{r["state_vs_even_split"]} (/{r["split_ways"]})' if 'split_ways' in r else ''
    lines.append(f'| {r["model"]} | {r["setting"]} | {r["compile_seconds"]:.1f} | '
                 f'{_mib(r["state_bytes"])} | {_mib(r["temp_bytes"])} | {_mib(r["peak_bytes"])} | '
                 f'{kept} | {split} |')
  long = [r for r in results if 'longest_t_within_limit' in r]
  if long:
    lines += ['', '| long context | temp bytes per token (per device) | longest T within '
              f'{long[0]["limit_mib"]:,} MiB per device |', '| --- | --- | --- |']
    lines += [f'| {r["setting"]} | {r["temp_bytes_per_token"]:,.0f} | '
              f'{r["longest_t_within_limit"]:,} |' for r in long]
  return '\n'.join(lines)


def main(argv):
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  import jax  # pylint: disable=g-import-not-at-top
  if _ACCELERATOR.value:
    if jax.devices()[0].platform == 'cpu':
      print('error: --accelerator: this host has no GPU or TPU; leave the flag out for the CPU '
            'rows', file=sys.stderr)
      sys.exit(2)
    results = accelerator_rows()
  else:
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', 8)
    results = rows()
  print(table(results))
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump({'results': results}, f, indent=2)


if __name__ == '__main__':
  sys.path.insert(0, _ROOT)
  app.run(main)

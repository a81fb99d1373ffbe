"""A/B rows of the performance levers: one model, one process, variants timed one after another.

  python benchmarks/levers.py --config=launch/configs/llama.py:llama3_1b \\
      --set=precision.compute_dtype=bfloat16,global_batch_size=8 \\
      --variants='model.remat=full;model.remat=minimal;model.scan_unroll=2,model.remat=full'

Each variant is the base config with its overrides, built by disttrain.setup as train() builds
it, compiled ahead of time (per-device memory from XLA), warmed up, then timed over `--windows`
windows of about `--window_sec` each; the row reports the median ms/step, tokens/s, MFU (model
FLOPs against the accelerator table's peak) and the ratio against the first variant. Variants run
in sequence, not interleaved, since two copies of a large model's state need not fit at once: on
an accelerator the windows' spread (reported) shows how far that matters; on a shared CPU host
prefer benchmarks/throughput.py's paired windows. A variant that does not fit, does not compile
or that setup refuses is reported with its one-line error and the others still run. Results:
--json=PATH, rewritten after every variant.
"""

import gc
import importlib.util
import json
import os
import statistics
import sys
import time

from absl import app, flags, logging
import jax
import numpy as np

import baselines
import disttrain
from disttrain import config as config_lib
from disttrain.parallel.step import Variant
from disttrain.training import setup as run_lib

_CONFIG = flags.DEFINE_string('config', 'launch/configs/llama.py:tiny', 'Config file:size.')
_SET = flags.DEFINE_string('set', '', 'Overrides of every variant: key=value,key=value.')
_VARIANTS = flags.DEFINE_string('variants', 'model.remat=none', "Variants, ';'-separated, each "
                                'key=value,... over --set; the first is the ratios\' baseline.')
_WINDOWS = flags.DEFINE_integer('windows', 5, 'Timed windows per variant (at least 3).')
_WINDOW_SEC = flags.DEFINE_float('window_sec', 1.0, 'About this many seconds per window.')
_FAKE_DEVICES = flags.DEFINE_integer('fake_devices', None, 'Run on N CPU devices.')
_JSON = flags.DEFINE_string('json', None, 'Write {"results": [...]} here.')


def overrides(text: str) -> list[tuple[str, str]]:
  """'a.b=1,c=x' -> [('a.b', '1'), ('c', 'x')]; one clear error for an entry without '='."""
  pairs = []
  for item in filter(None, (s.strip() for s in text.split(','))):
    key, eq, value = item.partition('=')
    if not eq or not key:
      raise ValueError(f'override {item!r} is not key=value; e.g. model.remat=minimal')
    pairs.append((key.strip(), value.strip()))
  return pairs


def config(path_size: str, pairs: list[tuple[str, str]]):
  """The config file's ConfigDict with the overrides (values parsed as the field's type)."""
  path, _, size = path_size.partition(':')
  spec = importlib.util.spec_from_file_location('levers_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cd = module.get_config(size) if size else module.get_config()
  cd.data.name = 'synthetic_tokens'  # the step alone: no tokenizing, no files
  cd.eval_every_steps = 0
  for key, value in pairs:
    *parents, leaf = key.split('.')
    node = cd
    try:
      for name in parents:
        node = getattr(node, name)
      old = getattr(node, leaf)
    except (AttributeError, KeyError):
      raise ValueError(f'{key} is no config field; see disttrain/config_reference.py') from None
    if isinstance(old, bool):
      value = value.lower() in ('1', 'true', 'yes')
    setattr(node, leaf, type(old)(value) if old is not None else value)
  return config_lib.from_config_dict(cd)


def measure(cfg, devices) -> dict:
  """Compiles the quiet train step for cfg and times it; ms/step median and spread."""
  run = disttrain.setup(cfg, devices=devices)
  lm = run_lib.throughput(run)
  step, variant = run.steps, Variant(metrics=False, steps=1, full_batch=True)
  batches = baselines.numpy_batches(run.train_data, cfg.global_batch_size, 2)
  inputs = [jax.device_put(b, run.batch_sharding) for b in batches]
  state = step.place(run.state)
  run.state = None  # donated below
  info = step.compile(variant, state, inputs[0])
  state, out = step.train(state, inputs[0], variant)  # first run: allocator, autotuning
  jax.block_until_ready(out)

  def window(n: int) -> float:
    nonlocal state
    start = time.perf_counter()
    for i in range(n):
      state, out = step.train(state, inputs[i % 2], variant)
    jax.block_until_ready((state, out))
    return time.perf_counter() - start

  n = max(3, int(_WINDOW_SEC.value / max(window(3) / 3, 1e-6)))
  ms = sorted(1e3 * window(n) / n for _ in range(_WINDOWS.value))
  med = statistics.median(ms)
  row = dict(ms_per_step=round(med, 3), global_batch_size=cfg.global_batch_size,
             examples_per_sec=round(cfg.global_batch_size * 1e3 / med, 2),
             spread=round((ms[-1] - ms[0]) / med, 4),
             steps_per_window=n, compile_sec=round(info.compile_seconds, 2),
             peak_bytes_per_device=info.peak_bytes, temp_bytes_per_device=info.temp_bytes,
             loss=float(np.asarray(out['loss']).reshape(-1)[0]))
  if lm.tokens_per_example:
    tokens = cfg.global_batch_size * 1e3 / med * lm.tokens_per_example
    row['tokens_per_sec'] = round(tokens, 1)
    if lm.peak:
      row['mfu'] = round(tokens / lm.tokens_per_example * lm.flops_per_example / lm.peak, 4)
  return row  # the state and inputs go with this frame


def table(rows: list[dict]) -> str:
  head = ('variant', 'ms/step', 'spread', 'ratio', 'tokens/s', 'MFU', 'peak MiB/dev', 'compile s')
  mfu = lambda r: f"{r['mfu']:.3f}" if 'mfu' in r else '-'  # no table peak (CPU)
  lines = [head]
  for r in rows:
    if 'error' in r:
      lines.append((r['variant'], 'error: ' + r['error'][:90], '', '', '', '', '', ''))
      continue
    lines.append((r['variant'], f"{r['ms_per_step']:.2f}", f"{r['spread']:.3f}",
                  f"{r['ratio']:.3f}" if r.get('ratio') else '-',
                  f"{r.get('tokens_per_sec', 0):,.0f}", mfu(r),
                  f"{r['peak_bytes_per_device'] / 2**20:,.0f}", f"{r['compile_sec']:.1f}"))
  widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
  text = ['  '.join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
          for line in lines]
  text.append('ratio = examples/s against the first variant\'s (> 1: faster); spread = '
              '(slowest - fastest window) / median')
  return '\n'.join(text)


def main(argv):
  if len(argv) > 1:
    _fail(f'unexpected arguments {argv[1:]}; pass settings as flags', 2)
  if _FAKE_DEVICES.value is not None:
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', _FAKE_DEVICES.value)
  if _WINDOWS.value < 3:
    _fail(f'--windows={_WINDOWS.value}: medians need at least 3 windows; pass >= 3', 2)
  try:
    base = overrides(_SET.value)
    variants = [overrides(v) for v in _VARIANTS.value.split(';')]
  except ValueError as e:
    _fail(str(e), 2)
  devices, rows = jax.devices(), []
  print(f'{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}, XLA_FLAGS='
        f'{os.environ.get("XLA_FLAGS", "")!r}', flush=True)
  for pairs in variants:
    name = ','.join(f'{k}={v}' for k, v in pairs) or 'base'
    try:
      cfg = config(_CONFIG.value, base + pairs)
    except (AttributeError, ValueError, disttrain.DisttrainError) as e:
      _fail(f'variant {name!r}: {e}', 2)
    try:
      row = dict(variant=name, **measure(cfg, devices))
    except Exception as e:  # pylint: disable=broad-except
      first = str(e).strip().splitlines()[0] if str(e).strip() else ''
      row = dict(variant=name, error=f'{type(e).__name__}: {first}')  # e.g. out of memory
    gc.collect()
    first_ok = next((r for r in rows if 'error' not in r), row if 'error' not in row else None)
    if 'error' not in row and first_ok is not None:
      row['ratio'] = round(row['examples_per_sec'] / first_ok['examples_per_sec'], 4)
    rows.append(dict(row, config=_CONFIG.value, set=_SET.value, devices=len(devices),
                     device_kind=devices[0].device_kind, jax=jax.__version__,
                     xla_flags=os.environ.get('XLA_FLAGS', '')))
    print(table(rows[-1:]).splitlines()[1], flush=True)
    if _JSON.value:  # after every variant: a run stopped at its time limit keeps what it measured
      with open(_JSON.value, 'w', encoding='utf-8') as f:
        json.dump({'results': rows}, f, indent=2)
  print(table(rows))


def _fail(message: str, code: int):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  app.run(main)

"""disttrain's train step against a hand-written jax.jit + optax step, timed in one process.

  python benchmarks/throughput.py --model=mlp --fake_devices=8 --sharding=fsdp --json=out.json

Every figure is a ratio against a baseline measured in the same process, window by window
(disttrain, baseline, baseline, disttrain, ...): machines are shared and noisy, so absolute
examples/s drift while the median of paired ratios barely does. Both sides run the same model on
the same device-resident batches, devices and layout, with the state donated; on a CPU mesh of
more than one device both wait for step N-1 after dispatching step N (as disttrain's loop does:
XLA:CPU's all-reduce deadlocks when many multi-device steps are queued). A step that compiles
during a timed window stops the run (exit 1, one line); bad flags exit 2, one line.
"""

import dataclasses
import importlib.util
import json
import os
import sys
import tempfile

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

import baselines
from baselines import BenchError, RecompileError, StepSide
import disttrain
from disttrain import config as config_lib, data, models
from disttrain.models.linen import LinenModel
from disttrain.parallel.step import Variant
from disttrain.training import setup as run_lib

_MODEL = flags.DEFINE_enum('model', 'mlp_small',
                           ['mlp_small', 'mlp', 'transformer', 'gpt', 'llama', 'moe'],
                           'mlp_small: seed 000 (784-64-64-10, batch 256); mlp: seed 004 '
                           '(mnist_mlp, Dropout + BatchNorm, batch 128); transformer: char_lm; '
                           'gpt / llama: launch/configs/gpt.py / llama.py at --size (with '
                           '--with_data, llama reads packed, tokenized documents); moe: llama '
                           'at --size with 8 experts, 2 per token.')
_SIZE = flags.DEFINE_string('size', None, '--model=gpt or llama: a size of its config file '
                            '(default: small / tiny).')
_GPT_SIZE = flags.DEFINE_string('gpt_size', None, 'Deprecated name of --size for --model=gpt.')
_DOCUMENTS = flags.DEFINE_integer('documents', 120, '--model=llama --with_data: standard library '
                                  'modules in the packed corpus.')
_PRECISION = flags.DEFINE_enum('precision', 'float32', ['float32', 'bfloat16'],
                               'precision.compute_dtype of both sides.')
_MATMUL = flags.DEFINE_enum('matmul', 'default', ['default', 'float8'],
                            "precision.matmul of both sides (float8: the language models' block "
                            'projections, with --precision=bfloat16); run once with each to time '
                            'float8 against bf16.')
_GRAD_ACCUM = flags.DEFINE_integer('grad_accum_steps', 1, 'Micro-batches per step, both sides '
                                   '(the hand-written step scans them too).')
_REMAT = flags.DEFINE_enum('remat', 'none', list(config_lib.REMAT),
                           '--model=transformer, gpt, llama or moe: model.remat, what the '
                           'backward pass keeps (the module is shared by both sides).')
_SCAN_UNROLL = flags.DEFINE_integer('scan_unroll', 1, '--model=transformer, gpt, llama or moe: '
                                    'model.scan_unroll, blocks per iteration of the layer scan.')
_SHARDING = flags.DEFINE_enum('sharding', 'replicate', ['replicate', 'fsdp', 'tensor', 'expert'],
                              'replicate: data parallel; fsdp: mesh.fsdp = all devices; tensor: '
                              'mesh.tensor = 2, hidden features split; expert: mesh.expert = all '
                              'devices (--model=moe).')
_ATTENTION = flags.DEFINE_enum('attention', None, ['auto', 'xla', 'cudnn', 'blockwise'],
                               '--model=gpt, llama or moe: model.attention of both sides '
                               "(default: the config's, auto).")
_STEP_MODE = flags.DEFINE_enum('step_mode', 'jit', ['jit', 'shard_map', 'pmap'], 'Step style.')
_BATCH = flags.DEFINE_integer('global_batch_size', 0, "0 = the model's seed batch size.")
_FAKE_DEVICES = flags.DEFINE_integer('fake_devices', None, 'Run on N CPU devices.')
_STEPS = flags.DEFINE_integer('steps', 0, 'Steps per timed window; 0 = about 0.3 s worth.')
_WINDOWS = flags.DEFINE_integer('windows', 25, 'Timed windows per side (at least 3).')
_STEPS_PER_DISPATCH = flags.DEFINE_integer(
    'steps_per_dispatch', 1, 'K > 1: disttrain runs K steps per call (Step.train_many); the '
    'baseline stays one call per step.')
_WITH_DATA = flags.DEFINE_bool('with_data', False, 'Also time the whole disttrain.train loop '
                               '(grain pipeline, metrics) against the step on device data.')
_WITH_KERAS = flags.DEFINE_bool('with_keras', False, 'Also time Keras 3 fit on mlp_small.')
_PREFETCH = flags.DEFINE_integer('prefetch', None, "--with_data: the loop's data.prefetch "
                                 '(default: the config default).')
_JSON = flags.DEFINE_string('json', None, 'Write {"results": [...]} here.')
_PROFILE = flags.DEFINE_string('profile', None, 'Write a jax.profiler trace of one window of '
                               'each side here.')

_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch',
                        'configs')
_CHAR_LM_CONFIG = os.path.join(_CONFIGS, 'char_lm.py')
_SEED = {'mlp_small': dict(batch=256, hidden=64, dropout=0.0),
         'mlp': dict(batch=128, hidden=512, dropout=0.3)}
_WINDOW_SEC = 0.1  # auto --steps: many short paired windows average out the host's bursts
_NUM_BATCHES = 4  # distinct device-resident batches each side cycles through


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, with a bad flag reported in one line (exit 2) instead of absl's FATAL."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(f'{e}; run with --helpfull to list the flags', 2)


def main(argv):
  if len(argv) > 1:
    _fail(f'unexpected arguments {argv[1:]}; pass settings as flags, e.g. --model=mlp', 2)
  if _FAKE_DEVICES.value is not None:
    if _FAKE_DEVICES.value < 1:
      _fail(f'--fake_devices={_FAKE_DEVICES.value} must be >= 1', 2)
    jax.config.update('jax_platforms', 'cpu')  # before the backend initialises
    jax.config.update('jax_num_cpu_devices', _FAKE_DEVICES.value)
  # A persistent compilation cache in a fresh folder: the first compile of each step is still a
  # cold one (compile_sec), while re-compiles of the same executable (the memory analysis, each
  # --with_data window's whole disttrain.train run) become cache reads.
  cache = tempfile.TemporaryDirectory(prefix='throughput_xla_cache_')  # removed at exit
  jax.config.update('jax_compilation_cache_dir', cache.name)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  try:
    rows = run()
  except RecompileError as e:
    _fail(f'RecompileError: {e}', 1)
  except (BenchError, disttrain.DisttrainError) as e:
    _fail(f'{type(e).__name__}: {e}', 2)
  print(table(rows))
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump({'results': rows}, f, indent=2)


def run() -> list[dict]:
  """Builds both steps, times them interleaved, adds the comparisons the flags ask for."""
  k = _STEPS_PER_DISPATCH.value
  devices = jax.devices()
  _check_flags(k, len(devices))
  cfg = _config(len(devices))
  # Others: the model train() would build (compute dtype, context length), made by setup.
  model = (LinenModel(baselines.SmallMLP(hidden=cfg.model.hidden)) if _MODEL.value == 'mlp_small'
           else None)
  run_ = disttrain.setup(cfg, model=model, devices=devices)
  lm = run_lib.throughput(run_)  # tokens and model FLOPs of language models
  compiles = [0]  # XLA compilations and persistent-cache hits: either means a step was rebuilt

  def count(event: str, *_, **__) -> None:
    compiles[0] += event in ('/jax/core/compile/backend_compile_duration',
                             '/jax/compilation_cache/cache_hits')
  jax.monitoring.register_event_duration_secs_listener(count)
  jax.monitoring.register_event_listener(count)
  keras_fit = _keras_fit(run_, k) if _WITH_KERAS.value else None
  disttrain_side, baseline_side, info = _build_sides(run_, devices, k, compiles)
  steps = _STEPS.value or baseline_side.calibrate(_WINDOW_SEC)
  steps = -(-steps // k) * k
  for side in (disttrain_side, baseline_side):
    side.steps = steps
    side()  # warm-up window: caches, allocator, thread pools

  windows = _WINDOWS.value
  load = [os.getloadavg()[0]]
  # The dot peak is sampled between the same windows, so fraction_of_peak compares like with like.
  peak = baselines.DotPeak(devices[0])
  secs, base_secs, peak_secs = baselines.interleave([disttrain_side, baseline_side, peak], windows)
  timings = [('step', 'jax_jit', (secs, base_secs))]
  if _WITH_DATA.value:
    # Whole runs, each at least ~1 s of steps, so start-up transients (the prefetch buffer
    # filling during compilation, the first record) stay out of the measured half.
    loop_side = baselines.LoopSide(cfg, model, devices, steps, run_steps=10 * steps)
    hand_loop = baselines.HandLoop(
        run_.train_data.read(np.arange(len(run_.train_data))), cfg.global_batch_size,
        run_.batch_sharding, baseline_side.fn, _copy(baseline_side.state), steps,
        run_steps=10 * steps, bound=baseline_side.bound)
    hand_loop()  # warm-up: compiles nothing new (the baseline's step), fills caches
    loop_secs, hand_secs, step_secs = baselines.interleave(
        [loop_side, hand_loop, disttrain_side], windows)
    timings.append(('train_loop', 'hand_written_loop', (loop_secs, hand_secs)))
    timings.append(('train_loop', 'step_on_device_data', (loop_secs, step_secs)))
  if keras_fit is not None:
    keras_fit.steps = steps
    keras_fit()  # warm-up: compiles Keras' train function
    timings.append(('step', 'keras_fit',
                    baselines.interleave([disttrain_side, keras_fit], windows)))
  load.append(os.getloadavg()[0])
  if _PROFILE.value:
    with jax.profiler.trace(_PROFILE.value):
      disttrain_side(), baseline_side()
  peak_flops = peak.flops / baselines.median(peak_secs)
  common = dict(model=_MODEL.value, sharding=_SHARDING.value, step_mode=cfg.step_mode,
                precision=cfg.precision.compute_dtype, matmul=cfg.precision.matmul,
                devices=len(devices), global_batch_size=cfg.global_batch_size,
                steps_per_dispatch=k, windows=windows, steps_per_window=steps,
                host_load_1m=round(max(load), 2), **info)
  # The whole run's peak: XLA:CPU's fake devices share the cores one dot already uses; GPUs add.
  total_peak = peak_flops * (len(devices) if devices[0].platform != 'cpu' else 1)
  rows = []
  for measured, against, (secs, base_secs) in timings:
    eps = [steps * cfg.global_batch_size / s for s in secs]
    base_eps = [steps * cfg.global_batch_size / s for s in base_secs]
    med, base_med = baselines.median(eps), baselines.median(base_eps)
    rows.append(dict(common, disttrain=measured, baseline=against,
                     examples_per_sec=round(med, 1), baseline_examples_per_sec=round(base_med, 1),
                     ratio=round(baselines.median([a / b for a, b in zip(eps, base_eps)]), 4),
                     ms_per_step=round(1e3 * cfg.global_batch_size / med, 4),
                     baseline_ms_per_step=round(1e3 * cfg.global_batch_size / base_med, 4),
                     fraction_of_peak=round(med * info['flops_per_example'] / total_peak, 4),
                     peak_flops_per_sec=round(peak_flops), peak_dtype=np.dtype(peak.dtype).name,
                     **_lm_fields(lm, med, total_peak)))
  return rows


def _keras_fit(run_: disttrain.Setup, k: int) -> baselines.KerasFit:
  """Keras 3 fit on the same data; built before any other side runs, since building Keras
  clears JAX's in-memory caches (measured with jax 0.12: a jitted function traces again)."""
  try:
    arrays = run_.train_data.read(np.arange(len(run_.train_data)))
    return baselines.KerasFit(arrays['image'], arrays['label'], run_.cfg.global_batch_size, k)
  except ImportError as e:
    raise BenchError(f'--with_keras needs Keras 3 with the JAX backend ({e}); pip install '
                     'keras, or drop --with_keras') from e


def _lm_fields(throughput, examples_per_sec: float, measured_peak: float) -> dict:
  """tokens_per_sec and MFU (model FLOPs: 6 N + attention, per token) for language models,
  against the accelerator table's peak, or on CPU the measured dot peak of this run (the whole
  run's, as fraction_of_peak's)."""
  if not throughput.flops_per_example:
    return {}
  table_peak = throughput.peak
  peak = table_peak or measured_peak
  return {'tokens_per_sec': round(examples_per_sec * throughput.tokens_per_example, 1),
          'model_flops_per_example': throughput.flops_per_example,
          'mfu': round(examples_per_sec * throughput.flops_per_example / peak, 4),
          'mfu_peak': 'table' if table_peak else 'measured dot peak'}


def _build_sides(run_: disttrain.Setup, devices, k: int, compiles: list):
  """disttrain's step (built by disttrain.setup, as train() builds it) and the hand-written one,
  from the same state."""
  cfg, state, lay, step = run_.cfg, run_.state, run_.layout, run_.steps
  batch_sharding = run_.batch_sharding
  base_shardings = {f.name: getattr(lay.shardings, f.name) for f in dataclasses.fields(state)}
  base_state = jax.device_put({name: getattr(state, name) for name in base_shardings},
                              base_shardings, may_alias=False)  # same values, its own buffers
  batches = baselines.numpy_batches(run_.train_data, cfg.global_batch_size, k * _NUM_BATCHES)
  bound = devices[0].platform == 'cpu' and len(devices) > 1
  if k > 1:  # K consecutive batches stacked: [K, B, ...], batch axis sharded as usual
    stacked = data.stacked_sharding(batch_sharding, k)
    inputs = [jax.device_put(jax.tree.map(lambda *xs: np.stack(xs), *batches[g * k:(g + 1) * k]),
                             stacked) for g in range(_NUM_BATCHES)]
  else:
    inputs = [jax.device_put(b, batch_sharding) for b in batches]
  # As the loop runs it: the quiet variant, and the full-metrics one on every logged step.
  quiet, logged = (Variant(metrics=m, steps=k, full_batch=True) for m in (False, True))
  disttrain_side = StepSide('disttrain step', lambda s, b: step.train(s, b, quiet),
                            step.place(state), inputs, k, bound,
                            lambda: sum(step.traces.values()), compiles,
                            logged_fn=lambda s, b: step.train(s, b, logged),
                            log_every=cfg.log_every_steps // k)
  run_.state = state = None  # donated to the first step
  base_traces = [0]
  task = run_.task
  base_fn = baselines.train_step_fn(run_.model.module, run_.tx, base_traces,
                                    run_.model.input_key,
                                    getattr(task, 'label_key', None) or task.target_key,
                                    jnp.dtype(cfg.precision.compute_dtype), cfg.grad_accum_steps,
                                    token_weighted=hasattr(task, 'weights'))
  baseline_side = StepSide('hand-written step',
                           baselines.jit_step(base_fn, base_shardings, batch_sharding), base_state,
                           [jax.device_put(b, batch_sharding) for b in batches], 1, bound,
                           lambda: base_traces[0], compiles)
  flops = baselines.flops_per_example(base_fn, base_state, batches[0])  # before it is donated
  # First calls on the same batch from the same state: compile time, and a check that both
  # sides compute the same step (dropout masks agree only in the jit style).
  compile_sec, metrics = disttrain_side.first_call()
  base_compile_sec, base_loss = baseline_side.first_call()
  loss = float(np.asarray(metrics['loss']).reshape(-1)[0])
  if (cfg.step_mode == 'jit' or not cfg.model.dropout) and not np.isclose(
      loss, float(base_loss), rtol=1e-4):
    raise BenchError(f'first-step loss: disttrain {loss:.6f}, hand-written {float(base_loss):.6f};'
                     ' the two steps do not compute the same thing')
  info = dict(compile_sec=round(compile_sec, 3), baseline_compile_sec=round(base_compile_sec, 3),
              state_bytes_per_device=step.compiled[quiet.name].state_bytes,
              flops_per_example=round(flops, 1))
  return disttrain_side, baseline_side, info


def _copy(tree):
  """Arrays with the same values and shardings in buffers of their own (steps donate them)."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)


def _check_flags(k: int, num_devices: int) -> None:
  """Flag combinations the benchmark cannot measure, as one-line errors."""
  if _MODEL.value == 'transformer' and ('char_lm' not in models.MODELS
                                        or not os.path.isfile(_CHAR_LM_CONFIG)):
    raise BenchError(f'--model=transformer needs the char_lm model and {_CHAR_LM_CONFIG}, which '
                     f'this checkout lacks (models: {tuple(models.MODELS)}); use --model=mlp_small'
                     ' or --model=mlp')
  if _WINDOWS.value < 3:
    raise BenchError(f'--windows={_WINDOWS.value}: medians need at least 3 windows; pass >= 3')
  if _STEPS.value < 0 or k < 1:
    raise BenchError(f'--steps={_STEPS.value} --steps_per_dispatch={k}: pass --steps >= 0 '
                     '(0 = auto) and --steps_per_dispatch >= 1')
  if k > 1 and _STEP_MODE.value == 'pmap':
    raise BenchError(f'--steps_per_dispatch={k} needs Step.train_many, which step_mode=pmap lacks;'
                     ' use --step_mode=jit or shard_map')
  if _WITH_KERAS.value and (_MODEL.value != 'mlp_small' or num_devices != 1):
    raise BenchError(f'--with_keras compares Keras fit on one device with --model=mlp_small; got '
                     f'--model={_MODEL.value} on {num_devices} devices')


def _config(num_devices: int):
  """disttrain's config for the flags: the seed MLPs on synthetic 784-feature data (Adam 1e-3),
  or launch/configs/char_lm.py's transformer on its text."""
  if _MODEL.value in ('transformer', 'gpt', 'llama', 'moe'):
    name = {'transformer': 'char_lm', 'moe': 'llama'}.get(_MODEL.value, _MODEL.value)
    spec = importlib.util.spec_from_file_location(f'{name}_config',
                                                  os.path.join(_CONFIGS, f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    size = _SIZE.value or _GPT_SIZE.value or {'gpt': 'small', 'llama': 'tiny'}.get(name)
    cd = module.get_config(size) if size else module.get_config()
    cd.model.remat = _REMAT.value
    cd.model.scan_unroll = _SCAN_UNROLL.value
    if _ATTENTION.value:
      cd.model.attention = _ATTENTION.value
    if _MODEL.value == 'moe':
      cd.model.num_experts, cd.model.experts_per_token = 8, 2
    if name == 'llama' and _WITH_DATA.value:
      _packed_documents(cd)
  else:
    seed = _SEED[_MODEL.value]
    cd = config_lib.defaults()
    cd.global_batch_size = seed['batch']
    cd.model.hidden, cd.model.dropout = seed['hidden'], seed['dropout']
    cd.data.name = 'synthetic'  # 784 features like MNIST, in memory, no download
    cd.logical_rules = (('hidden', 'tensor'),)
    if _SHARDING.value == 'fsdp':
      cd.sharding = 'fsdp'  # char_lm's rules already put its width ('embed') on fsdp
  cd.global_batch_size = _BATCH.value or cd.global_batch_size
  cd.precision.compute_dtype = _PRECISION.value
  cd.precision.matmul = _MATMUL.value
  cd.grad_accum_steps = _GRAD_ACCUM.value
  cd.step_mode = _STEP_MODE.value
  cd.steps_per_dispatch = _STEPS_PER_DISPATCH.value
  # Multiples of K, as the config requires; --with_data sets the loop's own. The step is timed
  # as the loop runs it: the full-metrics variant (grad_norm, ...) on logged steps only, 1 in 50.
  cd.log_every_steps = 50 * cd.steps_per_dispatch
  cd.num_train_steps = 10**6 * cd.steps_per_dispatch
  cd.eval_every_steps = 0
  if _PREFETCH.value is not None:
    cd.data.prefetch = _PREFETCH.value
  if _SHARDING.value == 'fsdp':
    cd.mesh.data, cd.mesh.fsdp = 1, -1
  elif _SHARDING.value == 'tensor':
    cd.mesh.tensor = min(2, num_devices)
  elif _SHARDING.value == 'expert':
    cd.mesh.data, cd.mesh.expert = 1, -1
  return config_lib.from_config_dict(cd)


_DOCS = tempfile.TemporaryDirectory(prefix='throughput_docs_')  # removed at exit


def _packed_documents(cd) -> None:
  """--model=llama --with_data: the standard library's modules as JSON-lines documents,
  tokenized (bytes) at start-up and packed whole into rows by best fit (data.packing)."""
  from disttrain.data import in_memory  # pylint: disable=g-import-not-at-top
  path = os.path.join(_DOCS.name, 'docs.jsonl')
  with open(path, 'w', encoding='utf-8') as f:
    for name in in_memory.text_files('')[:_DOCUMENTS.value]:
      with open(name, encoding='utf-8', errors='replace') as src:
        f.write(json.dumps({'text': src.read()}) + '\n')
  cd.data.name, cd.data.train_files, cd.data.tokenizer = 'documents', path, ''
  cd.data.packing = 'documents'
  cd.model.vocab_size = max(cd.model.vocab_size, 384)  # bytes and their end of sequence


def table(rows: list[dict]) -> str:
  """The results as an aligned text table, one row per comparison, and how to read it."""
  head = ('disttrain', 'baseline', 'model', 'layout', 'dev', 'batch', 'K', 'ex/s', 'base ex/s',
          'ratio', 'ms/step', 'base ms', 'compile s', 'state KiB/dev', 'MFLOP/ex', 'of peak')
  lines = [head] + [(
      r['disttrain'], r['baseline'], r['model'], f"{r['sharding']}/{r['step_mode']}",
      str(r['devices']), str(r['global_batch_size']), str(r['steps_per_dispatch']),
      f"{r['examples_per_sec']:,.0f}", f"{r['baseline_examples_per_sec']:,.0f}",
      f"{r['ratio']:.3f}", f"{r['ms_per_step']:.3f}", f"{r['baseline_ms_per_step']:.3f}",
      f"{r['compile_sec']:.2f}", f"{r['state_bytes_per_device'] / 1024:,.0f}",
      f"{r['flops_per_example'] / 1e6:.2f}", f"{r['fraction_of_peak']:.3f}") for r in rows]
  widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
  text = ['  '.join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
  first = rows[0]
  text.append(f'ratio = median over {first["windows"]} paired windows of disttrain / baseline '
              f'examples/s; peak = jnp.dot {first["peak_dtype"]} '
              f'{first["peak_flops_per_sec"] / 1e9:.0f} GFLOP/s; host load {first["host_load_1m"]} '
              f'on {os.cpu_count()} CPUs')
  return '\n'.join(text)


def _fail(message: str, code: int):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  app.run(main, flags_parser=_parse_flags)

"""disttrain against the trainer a language-model user would pick instead (MaxText), side by side.

  python benchmarks/peers.py                         # 1 device and 8 fake CPU devices, 4 layouts
  python benchmarks/peers.py --layouts=data8 --pairs=3 --json=peers.json
  python benchmarks/peers.py --layouts=data8 --profile   # + a traced run each: where the time goes

Each side trains the same Llama (launch/configs/llama.py at --size; MaxText's llama2 decoder with
the same widths, heads, SwiGLU, RMSNorm, RoPE, tied embeddings) on the same batch, sequence,
precision, optimizer (AdamW, clip 1.0, no dropout), devices and layout, through its own train
command, both on synthetic token rows (disttrain: `data.name=synthetic_tokens` through its grain
loop; MaxText: `dataset_type=synthetic`, generated on the devices). Runs alternate within one
invocation (disttrain, MaxText, MaxText, disttrain, ...) because this machine's speed drifts; each
run's steady state is its steps after --warmup (compilation included in those) over their seconds,
and a layout's ratio is the median of its pairs' ratios. MaxText runs in its own venv
(--peer_venv), installed on first use from the registry; it is never a dependency of disttrain.
--json writes one row per layout; `layout`, `peer`, `disttrain_tokens_per_sec`,
`peer_tokens_per_sec` and `ratio` are the contract.
"""

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

import op_profile
from disttrain.parallel import xla_flags  # decides 'GPU' as the launcher does

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location('llama_config',
                                               os.path.join(_ROOT, 'launch', 'configs', 'llama.py'))
llama_config = importlib.util.module_from_spec(_spec)  # the model both sides train
_spec.loader.exec_module(llama_config)

_LAYOUTS = flags.DEFINE_string(
    'layouts', '1,data8,fsdp8,data2.fsdp2.tensor2',
    "Comma-separated layouts: '1' = one device; otherwise axis sizes joined by '.', e.g. data8, "
    'fsdp8, data2.fsdp2.tensor2 (the product is the fake CPU device count on a CPU host).')
_SIZE = flags.DEFINE_enum('size', 'tiny', list(llama_config.SIZES), 'launch/configs/llama.py size.')
_BATCH = flags.DEFINE_integer('global_batch_size', 32, 'Rows per step (both sides).')
_SEQ = flags.DEFINE_integer('seq_len', 128, 'Tokens per row (both sides).')
_PRECISION = flags.DEFINE_enum('precision', 'float32', ['float32', 'bfloat16'],
                               "Compute dtype (disttrain precision.compute_dtype, MaxText dtype); "
                               'float32 parameters on both.')
_STEPS = flags.DEFINE_integer('steps', 120, 'Steps per run.')
_WARMUP = flags.DEFINE_integer('warmup', 20, 'Steps left out of the steady state (the compile).')
_PAIRS = flags.DEFINE_integer('pairs', 2, 'Alternating pairs of runs per layout.')
_REMAT = flags.DEFINE_string('remat', 'auto', "disttrain's model.remat (auto: its default, "
                             'dots_saveable on CPUs, none on GPUs).')
_PEER_REMAT = flags.DEFINE_string('peer_remat', 'minimal_with_context',
                                  "MaxText's remat_policy (its fastest: saves every projection "
                                  'and the attention context).')
_PEER_ATTENTION = flags.DEFINE_string(
    'peer_attention', None, "MaxText's attention (default: dot_product on CPUs, cudnn_flash_jax "
    "on GPUs: the cuDNN kernel disttrain's attention=auto picks there).")
_PEER = flags.DEFINE_enum('peer', 'maxtext', ['maxtext'], 'The peer trainer.')
_PEER_SPEC = flags.DEFINE_string('peer_spec', None, "pip requirement of the peer (default: "
                                 "maxtext[tpu]==0.2.5 on CPU hosts, maxtext[cuda12]==0.2.5 on GPUs)")
_PEER_VENV = flags.DEFINE_string('peer_venv', os.path.expanduser('~/.cache/disttrain/peers/maxtext'),
                                 "The peer's own venv (made on first use).")
_PEER_XLA_FLAGS = flags.DEFINE_string(
    'peer_xla_flags', '--xla_cpu_collective_call_terminate_timeout_seconds=600',
    "Extra XLA_FLAGS for the peer's runs. The default lets MaxText's collectives wait 600 s "
    'instead of 40: with steps queued without bound on 8 CPU devices of 2 cores, its '
    'data x fsdp x tensor runs aborted at 40 s.')
_TIMEOUT = flags.DEFINE_integer('timeout', 900, 'Seconds one run may take.')
_JSON = flags.DEFINE_string('json', None, 'Write {"results": [row per layout]} here.')
_PROFILE = flags.DEFINE_bool('profile', False, 'After the pairs, one more run per side that '
                             'traces 3 steps (10 after --warmup), kept out of the ratios; prints '
                             'where the step time goes, per kind of operation '
                             '(benchmarks/op_profile.py), and keeps the traces.')
_TRACED = 3

_AXES = ('data', 'fsdp', 'tensor')
_MAXTEXT_VERSION = '0.2.5'


class PeerError(Exception):
  """A side could not run, or a flag is wrong (code 2); the message says which and why."""

  def __init__(self, message: str, code: int = 1):
    super().__init__(message)
    self.code = code


def parse_layout(name: str) -> dict:
  """'data2.fsdp2.tensor2' -> {'data': 2, 'fsdp': 2, 'tensor': 2}; '1' -> {}."""
  if name == '1':
    return {}
  sizes = {}
  for part in name.split('.'):
    m = re.fullmatch(r'(data|fsdp|tensor)(\d+)', part)
    if not m or int(m.group(2)) < 1:
      raise PeerError(f'--layouts: {part!r} in {name!r} is not an axis and size such as data8, '
                      f'fsdp4 or tensor2 (axes: {", ".join(_AXES)})', code=2)
    sizes[m.group(1)] = int(m.group(2))
  return sizes


def _devices(sizes: dict) -> int:
  n = 1
  for v in sizes.values():
    n *= v
  return n


def peer_attention(gpu: bool) -> str:
  return _PEER_ATTENTION.value or ('cudnn_flash_jax' if gpu else 'dot_product')


def ensure_maxtext(venv: str) -> str:
  """The python of a venv holding MaxText, made and installed on first use (~3 GB, minutes)."""
  python = os.path.join(venv, 'bin', 'python')
  probe = [python, '-c', 'import maxtext.trainers.pre_train.train']
  if os.path.exists(python):
    found = subprocess.run(probe, capture_output=True, text=True)
    if not found.returncode:
      return python
    if not os.path.exists(os.path.join(venv, 'pyvenv.cfg')):  # pack_peer.py's folder: never pip
      raise PeerError(f'{python} cannot import MaxText: {found.stderr.strip()[-300:]}')
  extra = 'cuda12' if xla_flags.on_gpu(os.environ.get('JAX_PLATFORMS')) else 'tpu'
  spec = _PEER_SPEC.value or f'maxtext[{extra}]=={_MAXTEXT_VERSION}'
  print(f'installing {spec} into {venv} (its own venv; a few minutes, once)', flush=True)
  if not os.path.exists(python):
    subprocess.run([sys.executable, '-m', 'venv', venv], check=True)
  done = subprocess.run([python, '-m', 'pip', 'install', '--progress-bar=on', spec])
  if done.returncode or subprocess.run(probe, capture_output=True).returncode:
    raise PeerError(f'could not install {spec} into {venv}; see pip above, or pass --peer_venv '
                    'of a venv where `import maxtext` works')
  return python


def _env(devices: int, gpu: bool) -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED='1', TF_CPP_MIN_LOG_LEVEL='2')
  if not gpu:
    env['JAX_PLATFORMS'] = 'cpu'
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                        f' --xla_force_host_platform_device_count={devices}').strip()
  return env


def _run(cmd: list[str], env: dict, log: str) -> None:
  with open(log, 'w') as out:
    try:
      done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            timeout=_TIMEOUT.value, cwd=_ROOT)
    except subprocess.TimeoutExpired:
      raise PeerError(f'{cmd[2]} ran past --timeout={_TIMEOUT.value} s; log: {log}') from None
  if done.returncode:
    with open(log) as f:
      lines = f.read().splitlines()
    # XLA's fatal lines (F...: a collective's rendezvous timing out, say) say more than the tail.
    fatal = [line for line in lines if re.match(r'F\d{4} ', line)] or lines[-3:]
    raise PeerError(f'{" ".join(cmd[:3])} exited {done.returncode}; log: {log}: '
                    + ' | '.join(line[:300] for line in fatal[:3]))


def _trace_from() -> int:
  return _WARMUP.value + 10


def disttrain_run(sizes: dict, workdir: str, gpu: bool, profile: bool = False) -> float:
  """disttrain's steady-state tokens/s: its train records after --warmup, step-weighted."""
  devices = _devices(sizes)
  flag = lambda field, value: f'--config.{field}={value}'
  cmd = [sys.executable, '-m', 'disttrain.launch.train',
         f'--config={_ROOT}/launch/configs/llama.py:{_SIZE.value}', f'--workdir={workdir}',
         flag('data.name', 'synthetic_tokens'), flag('data.seq_len', _SEQ.value),
         flag('global_batch_size', _BATCH.value), flag('num_train_steps', _STEPS.value),
         flag('log_every_steps', _WARMUP.value), flag('eval_every_steps', 0),
         flag('data.eval_examples', _BATCH.value), flag('grad_clip_norm', 1.0),
         flag('precision.compute_dtype', _PRECISION.value), flag('model.remat', _REMAT.value)]
  cmd += [flag(f'mesh.{axis}', size) for axis, size in sizes.items()]
  if sizes.get('fsdp', 1) > 1:
    cmd.append(flag('sharding', 'fsdp'))
  if profile:
    cmd += [flag('profile.start_step', _trace_from()), flag('profile.num_steps', _TRACED)]
  if not gpu:
    cmd.append(f'--fake_devices={devices}')
  _run(cmd, _env(devices, gpu), os.path.join(workdir, 'log.txt'))
  steps = seconds = 0.0
  last = _WARMUP.value
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      r = json.loads(line)
      if r.get('split') == 'train' and r['step'] > _WARMUP.value:
        n = r['step'] - last
        steps, seconds = steps + n, seconds + n * _BATCH.value / r['examples_per_sec']
        last = r['step']
  if not steps:
    raise PeerError(f'disttrain wrote no train record past step {_WARMUP.value}: {workdir}')
  return steps * _BATCH.value * _SEQ.value / seconds


def maxtext_run(python: str, sizes: dict, workdir: str, gpu: bool, profile: bool = False) -> float:
  """MaxText's steady-state tokens/s: its per-step times after --warmup (metrics_file)."""
  devices = _devices(sizes)
  model, (_, _, learning_rate) = llama_config.SIZES[_SIZE.value]
  base = os.path.join(os.path.dirname(os.path.dirname(python)), 'lib',
                      f'python{sys.version_info.major}.{sys.version_info.minor}', 'site-packages',
                      'maxtext', 'configs', 'base.yml')
  metrics = os.path.join(workdir, 'metrics.jsonl')
  args = dict(
      run_name='peer', base_output_directory=workdir, hardware='gpu' if gpu else 'cpu',
      skip_jax_distributed_system='true', dataset_type='synthetic', steps=_STEPS.value,
      enable_checkpointing='false', decoder_block='llama2', base_emb_dim=model['hidden'],
      base_num_query_heads=model['num_heads'], base_num_kv_heads=model['num_kv_heads'],
      base_mlp_dim=model['mlp_dim'], base_num_decoder_layers=model['num_layers'],
      head_dim=model['hidden'] // model['num_heads'], vocab_size=model['vocab_size'],
      rope_max_timescale=int(model['rope_theta']), max_target_length=_SEQ.value,
      per_device_batch_size=_BATCH.value / devices, logits_via_embedding='true',
      normalization_layer_epsilon=1e-5, dtype=_PRECISION.value, weight_dtype='float32',
      opt_type='adamw', adam_weight_decay=0.1, gradient_clipping_threshold=1.0,
      learning_rate=learning_rate, dropout_rate=0, enable_dropout='false', remat_policy=_PEER_REMAT.value,
      attention=peer_attention(gpu),
      metrics_file=metrics, log_period=10**6, packing='false',
      ici_data_parallelism=sizes.get('data', 1), ici_fsdp_parallelism=sizes.get('fsdp', 1),
      ici_tensor_parallelism=sizes.get('tensor', 1))
  if profile:
    args.update(profiler='xplane', skip_first_n_steps_for_profiler=_trace_from(),
                profiler_steps=_TRACED)
  cmd = [python, '-m', 'maxtext.trainers.pre_train.train', base] + [
      f'{k}={v}' for k, v in args.items()]
  env = dict(_env(devices, gpu), DECOUPLE_GCLOUD='TRUE')  # MaxText's own off-Google-Cloud stubs
  env['XLA_FLAGS'] = f"{env.get('XLA_FLAGS', '')} {_PEER_XLA_FLAGS.value}".strip()
  _run(cmd, env, os.path.join(workdir, 'log.txt'))
  with open(metrics) as f:
    times = [r['perf/step_time_seconds'] for r in map(json.loads, f)
             if r['step'] >= _WARMUP.value]
  if not times:
    raise PeerError(f'MaxText wrote no step past {_WARMUP.value}: {workdir}')
  return len(times) * _BATCH.value * _SEQ.value / sum(times)


def measure(layout: str, python: str, gpu: bool, scratch: str) -> dict:
  sizes = parse_layout(layout)
  if _BATCH.value % _devices(sizes):
    raise PeerError(f'--global_batch_size={_BATCH.value} does not divide over {layout}\'s '
                    f'{_devices(sizes)} devices; pass a multiple', code=2)
  ours, peers, failures, profiles = {}, {}, [], {}
  runs = [(pair, side) for pair in range(_PAIRS.value)
          for side in (('disttrain', 'peer') if pair % 2 == 0 else ('peer', 'disttrain'))]
  if _PROFILE.value:  # traced runs of their own: a trace's cost stays out of the pairs' ratios
    runs += [('traced', 'disttrain'), ('traced', 'peer')]
  for pair, side in runs:
    workdir = tempfile.mkdtemp(prefix=f'{layout}_{side}_', dir=scratch)
    start, traced = time.time(), pair == 'traced'
    run = 'traced run' if traced else f'pair {pair + 1}/{_PAIRS.value}'
    try:
      value = (disttrain_run(sizes, workdir, gpu, traced) if side == 'disttrain' else
               maxtext_run(python, sizes, workdir, gpu, traced))
      if traced:
        profiles[side] = op_profile.summarize(workdir, _TRACED)
      else:
        (ours if side == 'disttrain' else peers)[pair] = value
    except (PeerError, FileNotFoundError, ValueError) as e:  # the row says so; the rest runs
      print(f'  {layout} {run} {side} failed: {e}', flush=True)
      failures.append(f"{'traced ' if traced else ''}{side}: {e}")
      continue
    print(f'  {layout} {run} {side}: {value:,.0f} tokens/s ({time.time() - start:.0f} s run)'
          + (f', trace in {workdir}' if traced else ''), flush=True)
  if len(profiles) == 2:
    print(f'  {layout}, where the step time goes (traced runs):')
    print(op_profile.table(['disttrain', _PEER.value], [profiles['disttrain'], profiles['peer']]))
  paired = sorted(p for p in ours if p in peers)  # every figure from complete pairs only
  ratios = [ours[p] / peers[p] for p in paired]
  median = lambda values: statistics.median(values) if values else None
  return dict(layout=layout, devices=_devices(sizes), peer=_PEER.value,
              disttrain_tokens_per_sec=median([ours[p] for p in paired]),
              peer_tokens_per_sec=median([peers[p] for p in paired]),
              ratio=median(ratios), ratios=ratios, failures=failures, size=_SIZE.value, global_batch_size=_BATCH.value,
              seq_len=_SEQ.value, precision=_PRECISION.value, steps=_STEPS.value,
              warmup=_WARMUP.value, remat=_REMAT.value, peer_remat=_PEER_REMAT.value,
              peer_attention=peer_attention(gpu),
              data='synthetic', date=time.strftime('%Y-%m-%d'),
              profile={side: dict(ms=p['ms'], span_ms=p['wall_ms'], steps=p['steps'])
                       for side, p in profiles.items()})


def main(argv):
  del argv
  try:
    layouts = _LAYOUTS.value.split(',')
    for layout in layouts:
      parse_layout(layout)
    if _STEPS.value <= _WARMUP.value:
      raise PeerError(f'--steps={_STEPS.value} must exceed --warmup={_WARMUP.value}', code=2)
    if not llama_config.SIZES[_SIZE.value][0].get('tied_embeddings'):
      raise PeerError(f'--size={_SIZE.value}: only tied-embedding sizes are mapped to MaxText',
                      code=2)
    gpu = xla_flags.on_gpu(os.environ.get('JAX_PLATFORMS'))
    python = ensure_maxtext(_PEER_VENV.value)
    rows = []
    scratch = tempfile.mkdtemp(prefix='peers_')
    for layout in layouts:
      rows.append(measure(layout, python, gpu, scratch))
    if not _PROFILE.value and not any(r['failures'] for r in rows):
      shutil.rmtree(scratch)  # a failed run's log stays for reading, and traces for TensorBoard
  except PeerError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(e.code)
  print(f'\n| layout | disttrain tokens/s | {_PEER.value} tokens/s | disttrain / {_PEER.value} |')
  print('| --- | --- | --- | --- |')
  figure = lambda value, spec: 'failed' if value is None else format(value, spec)
  for r in rows:
    print(f"| {r['layout']} | {figure(r['disttrain_tokens_per_sec'], ',.0f')} | "
          f"{figure(r['peer_tokens_per_sec'], ',.0f')} | {figure(r['ratio'], '.2f')} |")
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump({'results': rows}, f, indent=1)
  if any(r['failures'] for r in rows):
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)

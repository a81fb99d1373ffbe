"""Train a config: disttrain train --config=launch/configs/mnist_mlp.py --workdir=DIR.

(`python launch/train.py ...` is the same launcher; `disttrain check ...` is `--check`;
`disttrain batch-size ...` is `--find_batch_size`: the largest micro-batch per device that fits.)

Flags: --fake_devices=N gives N CPU devices; --config.<field>=<value> overrides any config field.
Besides get_config(), a config file may define get_data(config), get_model(config),
get_task(config), get_callbacks(config), get_rewards(config) and get_eval_extract(config) (HOOKS):
they give train() its data, model, task, callbacks, GRPO reward functions and the answer
extraction of data.eval_tasks' generation tasks, so the launcher trains a user's own
objects without editing disttrain.
Bad input (config, flags, data) exits with status 2 and one line naming the value and the fix.
"""

import math
import os
import re
import runpy
import sys
from typing import NoReturn

from absl import flags, logging
import ml_collections
from ml_collections import config_flags

from disttrain import commandline, errors
from disttrain.exitcodes import Exit
from disttrain.launch import config_args


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return int(value) if value and value.strip().isdigit() else None  # else _check_process_flags


_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (launch/configs/*.py).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for metrics, run.json, TensorBoard.')
_FAKE_DEVICES = flags.DEFINE_integer(
    'fake_devices', None, 'Run on N CPU devices (set before JAX initialises its backend).')
_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Initialise jax.distributed. Without --coordinator_address, JAX detects '
    'the cluster itself (Cloud TPU pods, SLURM, ...).')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', os.environ.get('JAX_COORDINATOR_ADDRESS'),
    'host:port of process 0 (implies --distributed). Env: JAX_COORDINATOR_ADDRESS.')
_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', _env_int('JAX_NUM_PROCESSES'), 'Processes in the job. Env: JAX_NUM_PROCESSES.')
_PROCESS_ID = flags.DEFINE_integer(
    'process_id', _env_int('JAX_PROCESS_ID'),
    'This process, 0..num_processes-1. Env: JAX_PROCESS_ID.')
_INIT_TIMEOUT = flags.DEFINE_integer(
    'distributed_init_timeout', 300, 'Seconds to wait for every process to join.')
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    'distributed_heartbeat_timeout', 100, 'Seconds without a heartbeat before a process is '
    'declared dead and the job stops.')
_CHECK = flags.DEFINE_bool(
    'check', False, 'Validate the flags and the config (fields, values, hooks) and exit 0 without '
    'touching jax, the devices or the workdir (tests/test_docs.py checks documented commands).')
_FIND_BATCH = flags.DEFINE_bool(
    'find_batch_size', False, 'Print the largest micro-batch per device whose compiled train step '
    'fits the memory limit less --headroom, and what it means for global_batch_size and '
    'grad_accum_steps; train nothing (no --workdir needed).')
_MEMORY_LIMIT = flags.DEFINE_integer(
    'memory_limit', None, '--find_batch_size: per-device bytes to fit (default: '
    'config.memory_limit_bytes, else the device\'s bytes_limit; CPU devices report none).')
_HEADROOM = flags.DEFINE_float(
    'headroom', 0.1, '--find_batch_size: the fraction of the limit kept free (allocator '
    'fragmentation, library workspaces).')
_BATCH_MULTIPLE = flags.DEFINE_integer(
    'batch_multiple', 0, '--find_batch_size: after the powers of two, bisect over multiples of '
    'this (e.g. 8); 0 = powers of two only.')
_XLA_DEFAULTS = flags.DEFINE_bool(
    'xla_defaults', True, "On NVIDIA GPUs, add disttrain's XLA flags (docs/performance.md) to "
    'XLA_FLAGS where it does not set them; --noxla_defaults keeps XLA\'s own defaults.')
flags.mark_flags_as_required(['config'])

# Config-file function -> the disttrain.train keyword it provides (get_data returns a dict of
# train_data / eval_data).
HOOKS = {'get_data': None, 'get_model': 'model', 'get_task': 'task', 'get_callbacks': 'callbacks',
         'get_rewards': 'rewards', 'get_eval_extract': 'eval_extract'}


def _check_specs(cfg) -> None:
  """The string fields a run parses when it sets up (eval tasks, a mixture and its stages),
  parsed now, so `disttrain check` refuses what the run would."""
  from disttrain.data import mixture  # pylint: disable=g-import-not-at-top
  from disttrain.evaluation import tasks  # pylint: disable=g-import-not-at-top
  from disttrain.parallel import mesh  # pylint: disable=g-import-not-at-top
  ways = mesh.known_batch_ways(cfg)  # the axes' sizes the config fixes
  if _FAKE_DEVICES.value and cfg.dcn_mesh.granules == 1:  # the devices known: the run's sizes
    devices = _FAKE_DEVICES.value * (_NUM_PROCESSES.value or 1)  # a cluster's: every process's
    sizes = dict(zip(mesh.AXES, mesh.resolve_shape(cfg.mesh, devices)))
    ways = math.prod(sizes[axis] for axis in mesh.BATCH_AXES)
  mesh.check_batch_split(cfg, ways)
  if cfg.data.eval_tasks:
    tasks.pairs(cfg.data.eval_tasks)
  if cfg.data.mixture:
    names = [name for name, _, _ in mixture.parse_sources(cfg.data.mixture)]
    if cfg.data.mixture_stages:
      mixture.parse_stages(cfg.data.mixture_stages, names)


def main(argv):
  del argv  # _parse_flags rejected positional arguments
  import disttrain  # pylint: disable=g-import-not-at-top  (names load on first use)
  try:
    # A bad config fails here, before jax loads and before joining a job.
    cfg = disttrain.from_config_dict(_CONFIG.value)
    config_args.agree_with_directory(cfg, sys.argv)
  except disttrain.DisttrainError as e:
    _fail(f'{type(e).__name__}: {e}')
  if _CHECK.value:
    try:
      _check_specs(cfg)
    except disttrain.DisttrainError as e:
      _fail(f'{type(e).__name__}: {e}')
    hooks = [name for name in HOOKS if callable(_config_module().get(name))]
    print(f'ok: --config={config_args.path(sys.argv)} builds a valid config '
          f'(model {cfg.model.name}, data {cfg.data.name}, {cfg.num_train_steps} steps'
          f'{", hooks " + ", ".join(hooks) if hooks else ""}); nothing was run')
    return
  from disttrain.parallel import xla_flags  # pylint: disable=g-import-not-at-top
  # XLA reads XLA_FLAGS when its backend starts: before the first jax use below.
  xla_flags.apply(_FAKE_DEVICES.value is None and
                  xla_flags.on_gpu(os.environ.get('JAX_PLATFORMS')), _XLA_DEFAULTS.value)
  import jax  # pylint: disable=g-import-not-at-top
  if _FAKE_DEVICES.value is not None:
    # Must happen before the first backend use; on CPU this gives N devices in this process.
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', _FAKE_DEVICES.value)
  from disttrain.parallel import distributed, failures  # pylint: disable=g-import-not-at-top
  watch = None
  try:
    if _DISTRIBUTED.value or _COORDINATOR.value:
      distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                             init_timeout=_INIT_TIMEOUT.value,
                             heartbeat_timeout=_HEARTBEAT_TIMEOUT.value)
    watch = failures.Watch()  # another process's failure ends this one (a no-op alone)
    if _FIND_BATCH.value:
      _find_batch_size(cfg)
    else:
      disttrain.train(cfg, _WORKDIR.value, **_hook_objects(cfg))
  except disttrain.Preempted as e:  # also Interrupted (Ctrl-C)
    print(e, flush=True)
    sys.exit(e.exit_code)  # 75 (SIGTERM) or 130 (Ctrl-C): a checkpoint was saved; relaunch
  except disttrain.DisttrainError as e:
    _fail(f'{type(e).__name__}: {e}')
  except Exception as e:  # a bug on one process: the others must not wait for it in a collective
    failures.announce(f'{type(e).__name__}: {e}', errors.exit_status(e), traceback=True)
    raise
  except SystemExit as e:  # sys.exit(N) in a hook of the user's: the job's status too
    if e.code not in (0, None):
      failures.announce(f'sys.exit({e.code!r})', errors.exit_status(e))
    raise
  finally:
    if watch is not None:
      watch.close()


def _find_batch_size(cfg) -> None:
  """Prints (on process 0) the largest micro-batch per device that fits, and its meaning."""
  import jax  # pylint: disable=g-import-not-at-top
  from disttrain.training import batch_size  # pylint: disable=g-import-not-at-top
  say = print if jax.process_index() == 0 else lambda _: None
  hooks = _hook_objects(cfg)
  found = batch_size.find(cfg, limit=_MEMORY_LIMIT.value, headroom=_HEADROOM.value,
                          multiple=_BATCH_MULTIPLE.value, model=hooks.get('model'),
                          task=hooks.get('task'), train_data=hooks.get('train_data'), say=say)
  say('\n'.join(found.lines()))


def _hook_objects(cfg) -> dict:
  """train() keywords from the config file's get_data / get_model / get_task / get_callbacks."""
  path, module = config_args.path(sys.argv).split(':', 1)[0], _config_module()
  kwargs = {}
  for name, keyword in HOOKS.items():
    if not callable(module.get(name)):
      continue
    value = module[name](cfg)
    if keyword is not None:
      kwargs[keyword] = value
    elif not (isinstance(value, dict) and set(value) <= {'train_data', 'eval_data'}
              and 'train_data' in value):
      _fail(f'--config={path!r}: get_data(config) returned {type(value).__name__}; return '
            "{'train_data': source, 'eval_data': source, {name: source} or None}")
    else:
      kwargs.update(value)
  return kwargs


def _config_module() -> dict:
  """The config file's globals (its get_data / get_model / ... hooks)."""
  return runpy.run_path(config_args.path(sys.argv).split(':', 1)[0])


def _check_process_flags() -> None:
  """One line for a job that could never start (it waited out the init timeout, or raised a
  ValueError traceback the supervisor restarted)."""
  for name, flag in (('JAX_NUM_PROCESSES', _NUM_PROCESSES), ('JAX_PROCESS_ID', _PROCESS_ID)):
    value = os.environ.get(name, '')
    if value.strip() and not value.strip().isdigit() and not flag.present:  # was ignored
      _fail(f'{name}={value!r} is not a number; set it to a count such as 2, or unset it '
            f'(--{flag.name}=N overrides it)')
  address, n, i = _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
  if address and not re.fullmatch(r'.+:\d{1,5}', address):
    _fail(f'--coordinator_address={address!r} is not host:port; pass e.g. '
          '--coordinator_address=10.0.0.1:8476 (process 0\'s host)')
  if address and not 0 < int(address.rsplit(':', 1)[1]) < 65535:  # the roll call takes port + 1
    _fail(f'--coordinator_address={address!r}: the port must be in 1..65534 (the roll call '
          'listens on port + 1); pass e.g. --coordinator_address=10.0.0.1:8476')
  if n is not None and n < 1:
    _fail(f'--num_processes={n} must be >= 1')
  if i is not None and (i < 0 or (n is not None and i >= n)):
    _fail(f'--process_id={i} must be in 0..{(n or 1) - 1} (--num_processes={n})')


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with every bad flag or config override reported as one `error:` line.

  absl alone prints a multi-line FATAL message (exit 1) for bad flag values, and config_flags
  raises a bare AttributeError traceback for an unknown --config.<field>; both happen before main.
  """
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    _fail(config_args.flag_error(e))
  except (AttributeError, KeyError, IndexError) as e:
    # config_flags looks each override up in the (locked) config; a miss is an unknown field.
    # Anything else (e.g. a bug inside the config file) keeps its traceback.
    message = config_args.unknown_field(argv) or config_args.no_get_config(argv, e)
    if message is None:
      raise
    _fail(message)
  except OSError as e:  # the config file failed to load and an override touched it
    _fail(config_args.load_error(argv, e))
  except errors.ConfigError as e:  # get_config refused its argument (a shipped config's size)
    _fail(f'ConfigError: {e}')
  config = _CONFIG.value
  try:
    getattr(config, 'to_dict', None)  # config_flags defers a load failure to the first access
  except OSError as e:
    _fail(config_args.load_error(argv, e))
  if not isinstance(config, ml_collections.ConfigDict):
    _fail(f'--config={config_args.path(argv)!r}: get_config() returned '
          f'{type(config).__name__}, not a ConfigDict; make it return one (start from '
          'disttrain.config.defaults())')
  if len(rest) > 1:
    _fail(f'unexpected arguments {rest[1:]}; pass settings as flags, e.g. '
          '--config.<field>=<value> (quote values with spaces)')
  if _FAKE_DEVICES.value is not None and _FAKE_DEVICES.value < 1:
    _fail(f'--fake_devices={_FAKE_DEVICES.value} must be >= 1; pass a device count such as '
          '--fake_devices=8, or leave it out to use the real devices')
  _check_batch_flags()
  _check_process_flags()
  workdir = _WORKDIR.value
  if workdir is not None and not workdir.strip():  # --workdir=$UNSET: not the current directory
    _fail(f'--workdir={workdir!r} is empty; pass --workdir=DIR')
  if workdir is None:
    if _FIND_BATCH.value:  # nothing is written
      return rest
    _fail('--workdir is required; pass --workdir=DIR')
  from disttrain.storage import urls  # pylint: disable=g-import-not-at-top
  try:
    bucket = urls.is_bucket(urls.resolve(workdir))  # a bad URL or a missing extra: now
  except errors.DisttrainError as e:
    _fail(str(e))
  # The path, or the nearest part of it that exists, must be a directory.
  existing = os.path.abspath(os.path.expanduser(workdir))
  while not bucket and not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not bucket and not os.path.isdir(existing):
    _fail(f'--workdir={workdir!r}: {existing} is a file, not a directory; pass a directory path '
          '(it is created if missing)')
  return rest


def _check_batch_flags() -> None:
  """--memory_limit, --headroom and --batch_multiple are the finder's, and in range."""
  given = [f for f in ('memory_limit', 'headroom', 'batch_multiple') if flags.FLAGS[f].present]
  if given and not _FIND_BATCH.value:  # train would ignore them
    _fail(f'--{given[0]} applies to `disttrain batch-size` (--find_batch_size); a run holds its '
          'compiled step to --config.memory_limit_bytes')
  if _MEMORY_LIMIT.value is not None and _MEMORY_LIMIT.value < 1:
    _fail(f'--memory_limit={_MEMORY_LIMIT.value} must be >= 1 byte; pass the per-device bytes, '
          'e.g. --memory_limit=17179869184 (16 GiB)')
  if not 0.0 <= _HEADROOM.value < 1.0:
    _fail(f'--headroom={_HEADROOM.value} must be in [0, 1); pass a fraction, e.g. 0.1')
  if _BATCH_MULTIPLE.value < 0:
    _fail(f'--batch_multiple={_BATCH_MULTIPLE.value} must be >= 0; pass e.g. 8, or 0 for powers '
          'of two')


def _fail(message: str) -> NoReturn:
  from disttrain.parallel import failures  # pylint: disable=g-import-not-at-top  (no jax import)
  failures.hold_if_leaving()
  print(f'error: {message}', file=sys.stderr, flush=True)
  failures.announce(message, Exit.BAD_INPUT)  # in a multi-process job: the others stop too
  sys.exit(Exit.BAD_INPUT)


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  commandline.run(main, _parse_flags)

"""Device mesh over ('data', 'fsdp', 'expert', 'context', 'tensor') from the config, checked against the
devices and against the batch and the model that will run on it."""

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from disttrain.config import (BATCH_AXES, EXPERT_AXIS, MESH_AXES, SEQUENCE_AXIS, Config,
                              MeshConfig)
from disttrain.errors import ConfigError


def resolve_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
  """Axis sizes with the -1 axis filled; raises ConfigError if they cannot cover the devices."""
  sizes = [getattr(cfg, axis) for axis in MESH_AXES]
  named = ' x '.join(f'{a}={s}' for a, s in zip(MESH_AXES, sizes))
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % fixed:
      raise ConfigError(f'mesh {named}: {num_devices} devices are not divisible by {fixed}; '
                        f'make the fixed axes divide {num_devices}')
    sizes[sizes.index(-1)] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(f'mesh {named} = {fixed} devices, but {num_devices} are present; make the '
                      f'product {num_devices} or set one axis to -1 (fill)')
  return tuple(sizes)


def build(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh for `cfg` over `devices` (default: every device of every process)."""
  devices = list(devices) if devices is not None else jax.devices()
  shape = resolve_shape(cfg, len(devices))
  # Auto axes: GSPMD propagates shardings from the ones we give to jit (in/out shardings).
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def axis_sizes(mesh: Mesh) -> dict[str, int]:
  """{axis: size}, as written to run.json."""
  return {name: int(size) for name, size in mesh.shape.items()}


def batch_ways(mesh: Mesh) -> int:
  """How many ways the global batch is split: the product of the batch axes."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch_sizes(cfg: Config, mesh: Mesh) -> None:
  """Both batch sizes split evenly over the batch axes; micro-batches over them too."""
  ways = batch_ways(mesh)
  for name, size in (('global_batch_size', cfg.global_batch_size),
                     ('eval_batch_size', cfg.eval_batch)):
    if size % ways:
      raise ConfigError(f'{name}={size} is not divisible by the {ways} devices on mesh axes '
                        f'{BATCH_AXES}; use a multiple of {ways}')
  m = cfg.grad_accum_steps
  if cfg.global_batch_size % (ways * m):
    raise ConfigError(f'global_batch_size={cfg.global_batch_size} does not split into '
                      f'grad_accum_steps={m} micro-batches over {ways} devices on mesh axes '
                      f'{BATCH_AXES}; use a multiple of {ways * m}')


def check_model(model, tokens: int, mesh: Mesh) -> None:
  """The context and expert axes fit the model: a sequence length the context axis divides,
  a number of experts the expert axis divides."""
  ways = mesh.shape[EXPERT_AXIS]
  experts = getattr(model, 'num_experts', 0)
  if ways > 1 and not experts:
    raise ConfigError(f'mesh.{EXPERT_AXIS}={ways} splits the experts of mixture-of-experts '
                      f'layers, but the model has none: set model.num_experts (language '
                      f'models) or use mesh.data={ways} for data parallelism')
  if experts % ways:
    raise ConfigError(f'model.num_experts={experts} is not divisible by mesh.{EXPERT_AXIS}='
                      f'{ways}; use a number of experts that is a multiple of {ways}')
  ways = mesh.shape[SEQUENCE_AXIS]
  if ways == 1:
    return
  if not getattr(model, 'splits_sequence', False):
    raise ConfigError(f'mesh.{SEQUENCE_AXIS}={ways} splits sequences, which only the language '
                      f'models do (gpt, llama); {type(model).__name__} does not: use '
                      f'mesh.{SEQUENCE_AXIS}=1')
  if tokens % ways:
    raise ConfigError(f'sequences of {tokens} tokens (data.seq_len) do not split over '
                      f'mesh.{SEQUENCE_AXIS}={ways}; use a length that is a multiple of {ways}')

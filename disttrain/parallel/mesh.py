"""The parallelism of a run: one object owns the device mesh and what each of its axes is for.

Axes, by role (config `mesh.<axis>`; the last get the closest devices):
  data     rows of the global batch; everything else replicated
  stage    pipeline stages: a language model's layers (logical 'layers'), micro-batched
  fsdp     rows of the batch, and each parameter's largest free dimension (sharding='fsdp')
  expert   rows of the batch, and the experts of mixture-of-experts layers (logical 'experts')
  context  the positions of a language model's sequences (logical 'sequence')
  tensor   what logical_rules map to it: heads, MLP features, the vocabulary
Nothing outside this module spells an axis: it asks a Parallelism for them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from disttrain.config import MESH_AXES
from disttrain.errors import ConfigError

AXES = MESH_AXES  # the config's mesh fields, outermost first: data, stage, fsdp, expert, ...
BATCH_AXES = ('data', 'fsdp', 'expert')  # the global batch's rows are split over these
FSDP_AXIS, EXPERT_AXIS, SEQUENCE_AXIS, STAGE_AXIS = 'fsdp', 'expert', 'context', 'stage'
TENSOR_AXIS = 'tensor'


def check_batch_split(cfg, ways: int) -> None:
  """Both batch sizes split evenly over `ways` batch devices; micro-batches over them too."""
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


def known_batch_ways(cfg) -> int:
  """The batch devices the config fixes without knowing the devices (an axis of -1 counts 1)."""
  return math.prod(max(getattr(cfg.mesh, a), 1) * max(getattr(cfg.dcn_mesh, a), 1)
                   for a in BATCH_AXES)


def resolve_shape(cfg, num_devices: int) -> tuple[int, ...]:
  """Axis sizes of a MeshConfig with the -1 axis filled; ConfigError if they cannot cover the
  devices."""
  sizes = [getattr(cfg, axis) for axis in AXES]
  named = ' x '.join(f'{a}={s}' for a, s in zip(AXES, sizes))
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


def build(cfg, devices: Sequence[jax.Device] | None = None, dcn=None) -> Mesh:
  """The mesh of a MeshConfig over `devices` (default: every device of every process); with a
  DcnMeshConfig of more than one granule, a hybrid mesh (`hybrid_devices`)."""
  devices = list(devices) if devices is not None else jax.devices()
  types = (AxisType.Auto,) * len(AXES)  # GSPMD propagates shardings from jit's in/out ones
  if dcn is None or dcn.granules == 1:
    return jax.make_mesh(resolve_shape(cfg, len(devices)), AXES, axis_types=types,
                         devices=devices)
  return Mesh(hybrid_devices(cfg, dcn, devices), AXES, axis_types=types)


def granule_ids(devices: Sequence[jax.Device], count: int) -> dict[jax.Device, int]:
  """Each device's granule, 0..count-1: its TPU slice where there are several slices, else its
  process's block of consecutive processes (one process each when count equals the processes;
  a node's processes when they are numbered node by node, as srun and torchrun do)."""
  slices = {getattr(d, 'slice_index', None) for d in devices}
  if len(slices) > 1 and None not in slices:
    slices = sorted(slices)  # numerically: slice 10 comes after 9
    if len(slices) % count:
      raise ConfigError(f'dcn_mesh multiplies to {count} granules, but the {len(slices)} TPU '
                        f'slices do not split into {count} equal groups; set dcn_mesh.* to '
                        'multiply to the number of slices or one that divides it')
    block = len(slices) // count  # consecutive slices per granule, as processes below
    return {d: slices.index(d.slice_index) // block for d in devices}
  processes = sorted({d.process_index for d in devices})
  if len(processes) % count:
    raise ConfigError(f'dcn_mesh multiplies to {count} granules, but the {len(processes)} '
                      f'processes (slices: {len(slices) if None not in slices else 0}) do not '
                      f'split into {count} equal groups; set dcn_mesh.* to multiply to the '
                      'number of slices, nodes or processes')
  block = len(processes) // count
  return {d: processes.index(d.process_index) // block for d in devices}


def hybrid_devices(cfg, dcn, devices: Sequence[jax.Device]) -> np.ndarray:
  """Devices in the mesh's shape: axis a has dcn_mesh.a x mesh.a entries, the granules
  outermost, so each granule's devices form the inner (mesh.*) block of every axis and the
  collectives of the axes whose dcn_mesh size is 1 stay inside a granule (as jax's
  create_hybrid_device_mesh lays them out; each granule's block by create_device_mesh, which
  knows a TPU slice's physical links)."""
  ids = granule_ids(devices, dcn.granules)
  groups = [[d for d in devices if ids[d] == g] for g in range(dcn.granules)]
  if len({len(g) for g in groups}) != 1:
    raise ConfigError(f'dcn_mesh: the {dcn.granules} granules hold '
                      f'{[len(g) for g in groups]} devices; every slice or node needs the same')
  inner = resolve_shape(cfg, len(groups[0]))
  outer = [getattr(dcn, a) for a in AXES]
  blocks = [mesh_utils.create_device_mesh(inner, g, allow_split_physical_axes=True)
            for g in groups]
  grid = np.stack(blocks).reshape(*outer, *inner)  # granules in row-major order over dcn axes
  n = len(AXES)
  order = [axis for i in range(n) for axis in (i, n + i)]  # (dcn_0, mesh_0, dcn_1, mesh_1, ...)
  return grid.transpose(order).reshape([o * i for o, i in zip(outer, inner)])


def crossing_axes(mesh: Mesh, granules: int | None = None) -> list[str]:
  """The mesh axes along which devices of different granules meet (run.json's dcn_axes);
  granules: dcn_mesh's count, default one per process."""
  devices = list(mesh.devices.flat)
  ids = granule_ids(devices, granules or len({d.process_index for d in devices}))
  grid = np.vectorize(ids.__getitem__)(mesh.devices)
  return [a for i, a in enumerate(AXES)
          if (np.moveaxis(grid, i, 0) != np.moveaxis(grid, i, 0)[:1]).any()]


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """A mesh over AXES and what follows from it: sizes by role, the batch's axes and shardings,
  the activation rules of jit-style steps, and the checks that a config and model fit it."""
  mesh: Mesh

  @classmethod
  def from_config(cls, cfg, devices: Sequence[jax.Device] | None = None,
                  dcn=None) -> Parallelism:
    return cls(build(cfg, devices, dcn))

  batch_axes = BATCH_AXES
  fsdp_axis, sequence_axis, stage_axis = FSDP_AXIS, SEQUENCE_AXIS, STAGE_AXIS

  @functools.cached_property
  def sizes(self) -> dict[str, int]:
    """{axis: size}, as written to run.json."""
    return {name: int(size) for name, size in self.mesh.shape.items()}

  @property
  def fsdp(self) -> int:
    return self.sizes[FSDP_AXIS]

  @property
  def context(self) -> int:
    return self.sizes[SEQUENCE_AXIS]

  @property
  def stages(self) -> int:
    return self.sizes[STAGE_AXIS]

  @property
  def experts(self) -> int:
    return self.sizes[EXPERT_AXIS]

  @property
  def batch_ways(self) -> int:
    """How many ways the global batch's rows are split."""
    return math.prod(self.sizes[a] for a in BATCH_AXES)

  @functools.cached_property
  def rows(self) -> NamedSharding:
    """Batches as the input pipeline places them: rows split over the batch axes, the rest whole
    (a [B, T] id array replicated along context costs B T ids; the step splits T itself)."""
    return NamedSharding(self.mesh, P(BATCH_AXES))

  def batch_spec(self, shape: tuple[int, ...], positions: int | None) -> P:
    """A batch field's spec: rows over the batch axes, and a sequence dimension (dim 1 of
    `positions` length: tokens, targets, segment ids) over context."""
    if len(shape) >= 2 and self.context > 1 and shape[1] == positions:
      return P(BATCH_AXES, SEQUENCE_AXIS)
    return P(BATCH_AXES)

  def constrain_batch(self, batch: dict, positions: int | None) -> dict:
    """Inside a jit-style step: each field split by batch_spec (slicing rows placed by `rows`
    along context moves no data)."""
    if self.context == 1:
      return batch
    return {k: jax.lax.with_sharding_constraint(
        v, NamedSharding(self.mesh, self.batch_spec(v.shape, positions))) for k, v in batch.items()}

  def without_fsdp(self, specs: Any) -> Any:
    """NamedShardings of parameter specs with the fsdp axis removed (whole along it)."""
    def drop(spec: P) -> NamedSharding:
      entries = []
      for entry in spec:
        names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,))
                      if n != FSDP_AXIS)
        entries.append(names if len(names) > 1 else (names[0] if names else None))
      return NamedSharding(self.mesh, P(*entries))
    return jax.tree.map(drop, specs, is_leaf=lambda x: isinstance(x, P))

  def activation_rules(self, logical_rules: tuple) -> dict:
    """Logical axes -> mesh axes: 'batch' to the batch axes, 'sequence' to context, 'experts'
    to expert, 'layers' (a scanned stack) to stage, the rest as logical_rules say."""
    stages = {'layers': STAGE_AXIS} if self.stages > 1 else {}
    return {'experts': EXPERT_AXIS, **stages, **dict(logical_rules), 'batch': BATCH_AXES,
            'sequence': SEQUENCE_AXIS}

  def check_batch_sizes(self, cfg) -> None:
    """Both batch sizes split evenly over the batch axes; micro-batches over them too, at least
    one per pipeline stage; sharding=fsdp has an fsdp axis to split over. On the resolved sizes:
    the config checks axes of -1 (fill) as 1."""
    check_batch_split(cfg, self.batch_ways)
    if self.stages > 1 and cfg.grad_accum_steps < self.stages:
      raise ConfigError(f'mesh.{STAGE_AXIS} fills {self.stages} stages on these devices, which '
                        f'need at least as many micro-batches, got grad_accum_steps='
                        f'{cfg.grad_accum_steps}; set grad_accum_steps >= {self.stages} (more cut '
                        'the pipeline bubble, (S - 1) / (M + S - 1))')
    if cfg.sharding == 'fsdp' and self.fsdp == 1 and self.mesh.size > 1:  # else replicated
      raise ConfigError(f"sharding='fsdp' splits parameters over mesh.{FSDP_AXIS}, which is 1 on "
                        f'these {self.mesh.size} devices (mesh {self.sizes}); set it, e.g. '
                        f'--config.mesh.data=1 --config.mesh.{FSDP_AXIS}=-1, or use '
                        "sharding='replicate'")

  def check_splits(self, split_axes: list[str]) -> None:
    """mesh.tensor > 1 splits some weight (`split_axes`: the axes the layout splits any over),
    else each group of tensor devices computes the same batch."""
    ways = self.sizes[TENSOR_AXIS]
    if ways > 1 and TENSOR_AXIS not in split_axes:
      raise ConfigError(
          f'mesh.{TENSOR_AXIS}={ways} splits no parameter: no param_rules or logical_rules '
          f"entry puts a dimension it divides on '{TENSOR_AXIS}', so each group of {ways} "
          f'devices would compute the same; map one (logical_rules by a logical axis name the '
          f"model gives, e.g. ('mlp', '{TENSOR_AXIS}'); param_rules by path for models without, "
          f"e.g. ('Dense_0/kernel', (None, '{TENSOR_AXIS}'))), or give those devices to mesh.data")

  def check_model(self, model, tokens: int) -> None:
    """The expert, stage and context axes fit the model: a number of experts the expert axis
    divides, a number of layers the stage axis divides, a sequence length the context axis
    divides."""
    ways, experts = self.experts, getattr(model, 'num_experts', 0)
    if ways > 1 and not experts:
      raise ConfigError(f'mesh.{EXPERT_AXIS}={ways} splits the experts of mixture-of-experts '
                        f'layers, but the model has none: set model.num_experts (language '
                        f'models) or use mesh.data={ways} for data parallelism')
    if experts % ways:
      raise ConfigError(f'model.num_experts={experts} is not divisible by mesh.{EXPERT_AXIS}='
                        f'{ways}; use a number of experts that is a multiple of {ways}')
    stages, layers = self.stages, getattr(model, 'num_layers', 0)
    if stages > 1 and not getattr(model, 'pipelines', False):
      raise ConfigError(f'mesh.{STAGE_AXIS}={stages} splits the layers of a language model '
                        f'(gpt, llama); {type(model).__name__} has none to split: use '
                        f'mesh.{STAGE_AXIS}=1')
    if stages > 1 and (experts or self.context > 1 or getattr(model, 'dropout', 0)):
      raise ConfigError(f'mesh.{STAGE_AXIS}={stages} with mixture-of-experts layers, '
                        f'mesh.{SEQUENCE_AXIS} > 1 or dropout is not built (got '
                        f'model.num_experts={experts}, mesh.{SEQUENCE_AXIS}={self.context}, '
                        f'dropout={getattr(model, "dropout", 0)}); use mesh.{STAGE_AXIS}=1 '
                        f'or leave those out')
    if stages > 1 and layers % stages:
      raise ConfigError(f'model.num_layers={layers} do not split into mesh.{STAGE_AXIS}='
                        f'{stages} stages of equal depth; use a stage count that divides '
                        f'{layers}')
    ways = self.context
    if ways == 1:
      return
    if not getattr(model, 'splits_sequence', False):
      raise ConfigError(f'mesh.{SEQUENCE_AXIS}={ways} splits sequences, which only the language '
                        f'models do (gpt, llama); {type(model).__name__} does not: use '
                        f'mesh.{SEQUENCE_AXIS}=1')
    if tokens % ways:
      raise ConfigError(f'sequences of {tokens} tokens (data.seq_len) do not split over '
                        f'mesh.{SEQUENCE_AXIS}={ways}; use a length that is a multiple of {ways}')


def axis_sizes(mesh: Mesh) -> dict[str, int]:
  """{axis: size}, as written to run.json."""
  return Parallelism(mesh).sizes


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Shards the leading (batch) axis over the mesh's batch axes; trailing axes stay whole."""
  return Parallelism(mesh).rows


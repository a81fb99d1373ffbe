"""How a run is laid out over devices: the mesh within a slice or process, the hybrid mesh across
them, the sharding and step styles, and tensor-parallel rules naming mesh axes."""

import dataclasses
import math
import re

from disttrain.errors import ConfigError

SHARDINGS = ('replicate', 'fsdp')
STEP_MODES = ('jit', 'shard_map', 'pmap')


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape, one size per axis (disttrain/parallel/mesh.py says what each is for); at
  most one axis may be -1, the devices left over. Their product is the number of devices."""
  data: int = -1  # data parallelism: each slice of the batch on its own replica of the state
  # Pipeline stages: a language model's layers split into this many stages (it must divide
  # model.num_layers); grad_accum_steps >= it are the micro-batches; step_mode=jit.
  stage: int = 1
  fsdp: int = 1  # splits the batch, and with sharding=fsdp each large parameter and its state
  # Splits mixture-of-experts experts (it must divide model.num_experts), and the batch elsewhere;
  # step_mode=jit.
  expert: int = 1
  # Context parallelism: splits each sequence's positions (language models; it must divide
  # data.seq_len); step_mode=jit.
  context: int = 1
  tensor: int = 1  # tensor parallelism: the dimensions param_rules / logical_rules map to 'tensor'

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    if list(sizes.values()).count(-1) > 1:
      raise ConfigError(f'mesh {sizes} has more than one -1 axis; give at most one axis -1 (fill)')
    for axis, size in sizes.items():
      if size != -1 and size < 1:
        raise ConfigError(f'mesh.{axis}={size} must be >= 1 or -1 (fill); set it to a positive '
                          'size or -1')


# The axes' names, outermost first; parallel/mesh.py's Parallelism spells each role.
MESH_AXES = tuple(f.name for f in dataclasses.fields(MeshConfig))
# Axes whose collectives run in every layer (activations): across slices or nodes they are slow.
LAYER_AXES = ('expert', 'context', 'tensor')


@dataclasses.dataclass(frozen=True)
class DcnMeshConfig:
  """Axis sizes across slices (TPU: devices' slice_index) or, elsewhere, across processes (each
  process a granule): the whole mesh is mesh.<axis> x dcn_mesh.<axis>, mesh.* within each
  granule on its fastest links (parallel/mesh.py). Default 1: one granule, a flat mesh."""
  data: int = 1  # data parallelism across slices or processes (the usual choice)
  stage: int = 1  # pipeline stages across them (one activation send per micro-batch)
  fsdp: int = 1  # fsdp across them: parameter all-gathers cross the slow links every step
  expert: int = 1  # refused unless allow_slow_axes: all-to-alls in every layer
  context: int = 1  # refused unless allow_slow_axes: exchanges in every attention layer
  tensor: int = 1  # refused unless allow_slow_axes: all-reduces in every layer
  allow_slow_axes: bool = False  # accept expert, context or tensor across slices or processes

  def __post_init__(self):
    for axis in MESH_AXES:
      if getattr(self, axis) < 1:
        raise ConfigError(f'dcn_mesh.{axis}={getattr(self, axis)} must be >= 1 (no -1 here: '
                          'mesh.* fills within a slice or process)')
    slow = [a for a in LAYER_AXES if getattr(self, a) > 1]
    if slow and not self.allow_slow_axes:
      raise ConfigError(f'dcn_mesh.{slow[0]}={getattr(self, slow[0])} puts the {slow[0]} axis '
                        'across slices or processes, whose links are the slowest, with '
                        'collectives in every layer; keep it in mesh.' + slow[0] + ', or set '
                        'dcn_mesh.allow_slow_axes=true if you mean it')

  @property
  def granules(self) -> int:
    return math.prod(getattr(self, a) for a in MESH_AXES)


def check_step_mode(mesh: MeshConfig, step_mode: str, sharding: str,
                    dcn: DcnMeshConfig | None = None) -> None:
  """The mesh axes each step style can carry: pmap is data parallel only, shard_map splits the
  batch, and the axes that split work inside one program (context, stage, expert) need jit. An
  axis counts with its dcn_mesh part: the whole mesh is mesh x dcn_mesh."""
  size = lambda axis: axis_size(mesh, dcn, axis)
  name = lambda axis: axis_label(mesh, dcn, axis)
  if step_mode == 'pmap' and (size('fsdp') != 1 or size('tensor') != 1
                              or sharding != 'replicate'):
    raise ConfigError(
        f'step_mode=pmap is data parallel only, got {name("fsdp")} {name("tensor")} '
        f'sharding={sharding}; use step_mode=jit or shard_map for fsdp/tensor layouts')
  for axis, what in (('context', 'splits sequences'), ('stage', 'pipelines layers'),
                     ('expert', 'splits experts')):
    if size(axis) != 1 and step_mode != 'jit':
      raise ConfigError(f'{name(axis)} {what} inside the jit step, not '
                        f'step_mode={step_mode}; use step_mode=jit')
  if step_mode == 'shard_map' and size('tensor') != 1:
    raise ConfigError(
        f'step_mode=shard_map splits the batch only, got {name("tensor")}; use '
        'step_mode=jit for tensor parallelism')


def axis_size(mesh: MeshConfig, dcn: DcnMeshConfig | None, axis: str) -> int:
  """The whole mesh's size along `axis`, mesh x dcn_mesh (-1: mesh.* fills, so some size)."""
  inner = getattr(mesh, axis)
  return -1 if inner == -1 else inner * (getattr(dcn, axis) if dcn is not None else 1)


def axis_label(mesh: MeshConfig, dcn: DcnMeshConfig | None, axis: str) -> str:
  """'mesh.stage=2', or 'mesh.stage=1 x dcn_mesh.stage=2' where dcn_mesh has a part of it."""
  outer = getattr(dcn, axis) if dcn is not None else 1
  return f'mesh.{axis}={getattr(mesh, axis)}' + (f' x dcn_mesh.{axis}={outer}' if outer != 1
                                                   else '')


def check_rules(param_rules, logical_rules) -> None:
  """param_rules and logical_rules are well formed and name only mesh axes (or None)."""
  for rule in param_rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
            and isinstance(rule[1], (tuple, list))):
      raise ConfigError(f'param_rules entry {rule!r} must be (regex, (axis or None, ...)); pass '
                        'e.g. --config.param_rules="((\'Dense_0/kernel\', (None, \'tensor\')),)"')
    try:
      re.compile(rule[0])
    except re.error as e:
      raise ConfigError(f'param_rules regex {rule[0]!r} does not compile ({e}); fix it') from None
    _check_axes(f'param_rules {rule[0]!r}', rule[1])
  for rule in logical_rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(f'logical_rules entry {rule!r} must be (logical name, mesh axis or None); '
                        'pass e.g. --config.logical_rules="((\'hidden\', \'tensor\'),)"')
    _check_axes(f'logical_rules {rule[0]!r}', (rule[1],))
  named = [rule[0] for rule in logical_rules]
  for name in dict.fromkeys(n for n in named if named.count(n) > 1):  # the last one won, silently
    given = [tuple(rule) for rule in logical_rules if rule[0] == name]
    raise ConfigError(f'logical_rules maps {name!r} {len(given)} times {given}; each logical name '
                      'maps once (no fallback list as in flax): keep one, or give a tuple of mesh '
                      f"axes to split over several, e.g. ({name!r}, ('tensor', 'fsdp'))")


def _check_axes(where: str, spec) -> None:
  for entry in spec:
    for axis in (entry if isinstance(entry, (tuple, list)) else (entry,)):
      if axis is not None and axis not in MESH_AXES:
        raise ConfigError(
            f'{where} names mesh axis {axis!r}, which is not one of {MESH_AXES}; use one of them '
            'or None')

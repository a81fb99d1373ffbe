"""Partition rules really split memory, and name what they cannot split."""

import dataclasses

import jax
import pytest

import disttrain
from disttrain.config import DcnMeshConfig, MeshConfig
from disttrain.errors import ConfigError, ShardingError
from disttrain.parallel import mesh as mesh_lib, sharding
from tests.helpers import devices, make_config


def _state(cfg):
  run = disttrain.setup(cfg, devices=devices(8))
  return run.state, run.layout


def _device0_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_fsdp_splits_large_kernels_and_their_optimizer_state():
  cfg = make_config(mesh__data=1, mesh__fsdp=8, sharding='fsdp')
  state, lay = _state(cfg)
  for name in ('Dense_0', 'Dense_1'):
    kernel = state.params[name]['kernel']
    assert kernel.addressable_shards[0].data.nbytes * 8 == kernel.nbytes, name
  adam = state.opt_state[0]
  assert adam.mu['Dense_1']['kernel'].addressable_shards[0].data.nbytes * 8 == \
      adam.mu['Dense_1']['kernel'].nbytes
  total = sum(x.nbytes for x in jax.tree.leaves(state.params))
  small = sum(x.nbytes for x in jax.tree.leaves(state.params) if x.size < cfg.fsdp_min_size)
  assert _device0_bytes(state.params) <= 1.1 * total / 8 + small
  # What stayed whole is reported with its reason.
  assert any('Dense_2/kernel' in line and 'fsdp_min_size' in line for line in lay.replicated)


def test_replicate_keeps_full_copies():
  state, _ = _state(make_config(mesh__data=8))
  assert _device0_bytes(state.params) == sum(x.nbytes for x in jax.tree.leaves(state.params))


def test_tensor_rules_from_logical_axes_and_paths():
  cfg = make_config(mesh__data=4, mesh__tensor=2,
                    param_rules=(('Dense_2/kernel', ('tensor', None)),))
  state, lay = _state(cfg)
  specs = sharding.spec_lists(lay.param_specs)
  assert specs['Dense_0/kernel'] == [None, 'tensor']  # logical 'hidden' -> tensor
  assert specs['BatchNorm_0/scale'] == ['tensor']
  assert specs['Dense_2/kernel'] == ['tensor', None]  # path rule beats logical rules
  assert state.params['Dense_1']['kernel'].addressable_shards[0].data.shape == (512, 256)


def test_rule_naming_a_missing_mesh_axis_is_rejected():
  with pytest.raises(ConfigError, match="names mesh axis 'model'") as err:
    make_config(mesh__data=8, param_rules=(('Dense_0/kernel', (None, 'model')),))
  assert '\n' not in str(err.value)
  with pytest.raises(ConfigError, match="names mesh axis 'nope'"):
    make_config(mesh__data=8, logical_rules=(('hidden', 'nope'),))
  # A flax-style fallback list: the last entry won and the tensor split was silently lost.
  with pytest.raises(ConfigError, match=r"logical_rules maps 'hidden' 2 times \[\('hidden', "
                                        r"'tensor'\), \('hidden', None\)\]; each logical name"):
    make_config(mesh__data=4, mesh__tensor=2, logical_rules=(('hidden', 'tensor'), ('hidden', None)))


def test_an_fsdp_or_tensor_layout_that_splits_nothing_is_one_line():
  """sharding='fsdp' on the default mesh (data=-1) replicated every parameter, silently."""
  with pytest.raises(ConfigError, match=r"sharding='fsdp' splits parameters over mesh.fsdp, "
                                        r'which is 1 on these 8 devices .*mesh.fsdp=-1'):
    disttrain.setup(make_config(sharding='fsdp'), devices=devices(8))
  disttrain.setup(make_config(mesh__data=1, sharding='fsdp'), devices=devices(1))  # 1 is 1
  # mesh.tensor with no rule naming it: every parameter replicated, each pair computing the same.
  with pytest.raises(ConfigError, match=r"mesh.tensor=2 splits no parameter: no param_rules or "
                                        r"logical_rules entry puts a dimension it divides on"):
    disttrain.setup(make_config(mesh__data=4, mesh__tensor=2, logical_rules=()),
                    devices=devices(8))


def test_rule_that_does_not_divide_is_one_line_error():
  cfg = make_config(mesh__data=1, mesh__tensor=8,
                    param_rules=(('Dense_2/kernel', (None, 'tensor')),))
  with pytest.raises(ShardingError, match='not divisible') as err:
    _state(cfg)
  assert '\n' not in str(err.value)


def test_an_axis_named_twice_is_one_line_or_kept_whole_as_flax_does():
  """A rule splitting two dimensions over one axis failed inside jax (DuplicateSpecError, a
  traceback). An explicit param rule is refused; logical names mapping two dimensions to one axis
  split the first and keep the second whole, as flax's logical_to_mesh_axes does."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  with pytest.raises(ShardingError, match=r"names mesh axis 'tensor' twice; an axis splits one "
                                          r'dimension'):
    _state(make_config(mesh__data=4, mesh__tensor=2,
                       param_rules=(('Dense_0/kernel', ('tensor', 'tensor')),)))
  rules = (('hidden', 'tensor'), ('mlp', 'tensor'))
  cfg = make_config(mesh__data=4, mesh__tensor=2, logical_rules=rules)
  mesh = mesh_lib.build(MeshConfig(data=4, tensor=2), devices(8))
  specs, whole = sharding.specs_for({'w': jax.ShapeDtypeStruct((8, 8), 'float32')}, cfg, mesh,
                                    logical={'w': P('hidden', 'mlp')})
  assert specs['w'] == nn.logical_to_mesh_axes(('hidden', 'mlp'), rules) == P('tensor', None)
  assert whole == ['w (8, 8): mlp maps to tensor, which an earlier dimension splits, kept whole']


def test_one_object_owns_the_axes_and_splits_each_batch_field():
  """mesh.Parallelism: sizes by role, rows over the batch axes, and inside a jit step the
  sequence fields ([B, T]) also over context; no other module spells an axis."""
  import pathlib
  import re
  import numpy as np
  from jax.sharding import PartitionSpec as P
  from disttrain.config import MeshConfig
  from disttrain.parallel.mesh import AXES, BATCH_AXES, Parallelism
  parallel = Parallelism.from_config(MeshConfig(data=2, context=2, tensor=2), devices(8))
  assert (parallel.batch_ways, parallel.context, parallel.fsdp) == (2, 2, 1)
  batch = {'tokens': np.zeros((4, 16), np.int32), 'targets': np.zeros((4, 16), np.int32),
           'image': np.zeros((4, 8, 8), np.float32), 'id': np.zeros((4,), np.int32)}
  placed = jax.device_put(batch, parallel.rows)
  split = jax.jit(lambda b: parallel.constrain_batch(b, 16))(placed)
  shards = {k: v.addressable_shards[0].data.shape for k, v in split.items()}
  assert shards == {'tokens': (2, 8), 'targets': (2, 8), 'image': (2, 8, 8), 'id': (2,)}
  assert parallel.batch_spec((4, 16), 16) == P(BATCH_AXES, 'context')
  assert parallel.batch_spec((4, 8, 8), 16) == P(BATCH_AXES)  # no dimension of 16 positions
  root = pathlib.Path(__file__).parent.parent / 'disttrain'
  # An axis name in a spec, a mesh shape lookup or a collective (docs and config values aside).
  literal = re.compile(r"""(P\(|shape\[|axis_name|psum|all_gather|make_mesh)[^#]*['"](%s)['"]"""
                       % '|'.join(AXES))
  spelled = [f'{path.relative_to(root)}:{n}' for path in sorted(root.rglob('*.py'))
             if path.name != 'mesh.py'
             for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
  assert not spelled, spelled


def test_dcn_mesh_refuses_layer_axes_across_granules_and_a_granule_count_that_is_not_there():
  """dcn_mesh: tensor, context and expert across slices or processes need the override; a
  hybrid mesh needs as many processes (granules here) as dcn_mesh multiplies to. The hybrid
  layout itself is run by test_multiprocess.py's 2 x 4 'hybrid' case."""
  with pytest.raises(ConfigError, match=r'dcn_mesh.tensor=2 puts the tensor axis across slices '
                     r'or processes.*keep it in mesh.tensor, or set dcn_mesh.allow_slow_axes'):
    make_config(dcn_mesh__tensor=2)
  with pytest.raises(ConfigError, match=r'dcn_mesh.context=0 must be >= 1'):
    make_config(dcn_mesh__context=0)
  assert make_config(dcn_mesh__tensor=2, dcn_mesh__allow_slow_axes=True).dcn_mesh.granules == 2
  with pytest.raises(ConfigError, match=r'dcn_mesh multiplies to 2 granules, but the 1 '
                     r'processes \(slices: 0\) do not split into 2 equal groups'):
    mesh_lib.build(MeshConfig(data=-1), devices(8), DcnMeshConfig(data=2))
  flat = mesh_lib.build(MeshConfig(data=2, tensor=4), devices(8), DcnMeshConfig())
  assert mesh_lib.crossing_axes(flat) == []  # one process: nothing crosses
  # TPU slices (device stand-ins): in numeric order (slice 10 sorted before 2), several to a
  # granule as processes are (half the devices were left out), a count that does not divide
  # them refused as such (it blamed unequal slices).
  @dataclasses.dataclass(frozen=True)
  class Device:
    id: int
    process_index: int
    slice_index: int
    platform: str = 'cpu'
    device_kind: str = 'cpu'
  chips = lambda slices, per: [Device(s * per + i, s, s) for s in range(slices) for i in range(per)]
  grid = mesh_lib.hybrid_devices(MeshConfig(data=2), DcnMeshConfig(data=12), chips(12, 2))
  assert [d.slice_index for d in grid.reshape(-1)] == [s for s in range(12) for _ in range(2)]
  grid = mesh_lib.hybrid_devices(MeshConfig(data=-1), DcnMeshConfig(data=2), chips(4, 2))
  assert [d.slice_index for d in grid.reshape(-1)] == [0, 0, 1, 1, 2, 2, 3, 3]
  with pytest.raises(ConfigError, match=r'the 2 TPU slices do not split into 4 equal groups'):
    mesh_lib.hybrid_devices(MeshConfig(data=-1), DcnMeshConfig(data=4), chips(2, 4))

"""The grain train stream and eval batches: determinism, coverage, resume, sharding, padding."""

import json

import jax
import numpy as np
import pytest

from disttrain import data
from disttrain.data import global_arrays
from disttrain.config import MeshConfig
from disttrain.data.records import ID, MASK, Records
from disttrain.errors import DataError
from disttrain.parallel import mesh as mesh_lib

N, B = 100, 16  # 6 batches per epoch, 4 examples dropped per epoch


def _mesh(n: int, shape: tuple[int, int, int] | None = None) -> jax.sharding.Mesh:
  """The run's mesh over the first n devices, data x fsdp x tensor = `shape` (default n x 1 x 1)."""
  data_, fsdp, tensor = shape or (n, 1, 1)
  return mesh_lib.build(MeshConfig(data=data_, fsdp=fsdp, tensor=tensor), jax.devices()[:n])


def _split(n: int = N) -> Records:
  """Records whose image and label are functions of the row, to check rows stay together."""
  rows = np.arange(n, dtype=np.int32)
  image = np.broadcast_to(1000 + rows[:, None, None, None], (n, 2, 3, 1)).astype(np.float32)
  return Records({'image': image, 'label': (rows % 10).astype(np.int32)}, 'train', 0)


def _ids(it, count: int) -> list[list[int]]:
  """The example ids of the next count batches."""
  return [np.asarray(next(it)[ID]).tolist() for _ in range(count)]


def _train(n_devices: int = 8, seed: int = 0, split: Records | None = None, **kwargs):
  """A TrainIterator over the test split on an n-device mesh."""
  sharding = mesh_lib.batch_sharding(_mesh(n_devices))
  return data.TrainIterator(split or _split(), B, seed, sharding, **kwargs)


def test_same_batches_on_1_and_8_devices():
  one, eight = _train(1), _train(8, prefetch=0)
  assert one.batches_per_epoch == eight.batches_per_epoch == N // B
  for _ in range(14):  # crosses two epoch boundaries
    a, b = next(one), next(eight)
    assert set(a) == set(b) == {'image', 'label', ID}  # no MASK: every train row is real
    for key in ('image', 'label', ID):
      np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
    # Rows stay whole: image and label belong to the id.
    np.testing.assert_array_equal(np.asarray(a['image'])[:, 0, 0, 0], 1000 + np.asarray(a[ID]))
    np.testing.assert_array_equal(np.asarray(a['label']), np.asarray(a[ID]) % 10)
  assert _ids(_train(8, seed=1), 3) != _ids(_train(8, seed=0), 3)


def test_epochs_cover_each_id_at_most_once_in_new_orders():
  it = _train()
  bpe = it.batches_per_epoch
  epochs = [np.concatenate(_ids(it, bpe)) for _ in range(3)]
  for ids in epochs:
    assert len(ids) == bpe * B and len(np.unique(ids)) == len(ids)
    assert set(ids) <= set(range(N))
  assert not np.array_equal(epochs[0], epochs[1])
  # The dropped remainder differs per epoch, so over epochs every example is seen.
  assert set(np.concatenate(epochs)) == set(range(N))


def test_get_state_set_state_resumes_exactly():
  it = _train()
  _ids(it, 7)
  state = json.loads(json.dumps(it.get_state()))
  expected = _ids(it, 6)
  fresh = _train()
  fresh.set_state(state)
  assert _ids(fresh, 6) == expected
  # A state does not silently resume a stream with another order.
  with pytest.raises(DataError, match='seed'):
    _train(seed=3).set_state(state)
  with pytest.raises(DataError):
    _train().set_state({'next_index': 3})


def test_arrays_have_the_requested_sharding():
  mesh = _mesh(8, (4, 2, 1))
  sharding = mesh_lib.batch_sharding(mesh)
  batch = next(data.TrainIterator(_split(), B, 0, sharding))
  assert batch['image'].shape == (B, 2, 3, 1) and batch['label'].shape == (B,)
  assert batch['label'].dtype == np.int32 and batch[ID].dtype == np.int32 and MASK not in batch
  for value in batch.values():
    assert value.sharding.is_equivalent_to(sharding, value.ndim)
    assert {s.data.shape[0] for s in value.addressable_shards} == {B // 8}
  for value in next(data.eval_batches(_split(), B, sharding)).values():
    assert value.sharding.is_equivalent_to(sharding, value.ndim)


def test_eval_visits_every_id_once_and_masks_padding():
  split = _split(N)  # 100 is not a multiple of 16: the last batch has 12 padding rows
  batches = list(data.eval_batches(split, B, mesh_lib.batch_sharding(_mesh(8))))
  assert len(batches) == 7
  ids = np.concatenate([np.asarray(b[ID]) for b in batches])
  mask = np.concatenate([np.asarray(b[MASK]) for b in batches])
  np.testing.assert_array_equal(ids[mask == 1], np.arange(N))
  assert mask.sum() == N and np.all(ids[mask == 0] == -1)
  last = batches[-1]
  pad = np.asarray(last[MASK]) == 0
  assert pad.sum() == 7 * B - N
  assert np.all(np.asarray(last['image'])[pad] == 0) and np.all(np.asarray(last['label'])[pad] == 0)


def test_local_rows_single_process_is_all_rows():
  rows = data.local_rows(mesh_lib.batch_sharding(_mesh(8)), 32)
  np.testing.assert_array_equal(rows, np.arange(32))
  # With the tensor axis replicating the batch, every row is still held by this process.
  sharding = mesh_lib.batch_sharding(_mesh(8, (2, 1, 4)))
  np.testing.assert_array_equal(data.local_rows(sharding, 4), np.arange(4))


class _OtherProcessSharding:
  """Stands in for a multi-process sharding: this process holds rows 4..7 and 12..15 only."""

  def addressable_devices_indices_map(self, shape):
    """Two local devices, each with a quarter of the batch."""
    quarter = shape[0] // 4
    return {'d1': (slice(quarter, 2 * quarter),), 'd3': (slice(3 * quarter, 4 * quarter),)}


def test_local_rows_follow_the_addressable_devices():
  rows = data.local_rows(_OtherProcessSharding(), 16)
  np.testing.assert_array_equal(rows, [4, 5, 6, 7, 12, 13, 14, 15])


def test_per_device_assembly_matches_process_local():
  sharding = mesh_lib.batch_sharding(_mesh(8, (2, 2, 2)))
  assemble = global_arrays.Assembler(sharding, B)
  local = {'image': np.arange(B * 3, dtype=np.float32).reshape(B, 3),
           'id': np.arange(B, dtype=np.int32)}
  whole, pieces = assemble(local), assemble(local, piecewise=True)
  for key, value in local.items():
    np.testing.assert_array_equal(np.asarray(pieces[key]), value)
    assert pieces[key].sharding.is_equivalent_to(whole[key].sharding, value.ndim)
  # K stacked batches ([K, B, ...], the batch on axis 1) take the same two paths.
  stacked = {k: np.stack([v, v + 1]) for k, v in local.items()}
  whole, pieces = assemble(stacked, batch_axis=1), assemble(stacked, piecewise=True, batch_axis=1)
  for key, value in stacked.items():
    np.testing.assert_array_equal(np.asarray(pieces[key]), value)
    np.testing.assert_array_equal(np.asarray(whole[key]), value)
    assert whole[key].sharding.spec[0] is None  # K is not split; the batch axis is
    assert pieces[key].sharding.is_equivalent_to(whole[key].sharding, value.ndim)


def test_errors_are_one_line():
  with pytest.raises(DataError, match=r'has 10 examples, fewer than global_batch_size=16') as e:
    _train(split=_split(10))
  assert '\n' not in str(e.value)
  with pytest.raises(DataError, match='multiple of 8'):
    data.TrainIterator(_split(), 12, 0, mesh_lib.batch_sharding(_mesh(8)))


def test_a_held_out_slice_reads_a_batch_in_one_call_of_its_source():
  """array_record's held-out tail (records.Slice) keeps grain's batched read (__getitems__)."""
  from disttrain.data.records import Slice  # pylint: disable=g-import-not-at-top

  class Batched:
    calls = []

    def __len__(self):
      return 10

    def __getitem__(self, i):
      return {'x': np.int32(i)}

    def __getitems__(self, indices):
      self.calls.append(list(indices))
      return [{'x': np.int32(i)} for i in indices]

  tail = Records(Slice(Batched(), 6, 10), 'eval', 0)
  Batched.calls.clear()
  np.testing.assert_array_equal(tail.read(np.asarray([3, 0, 2]))['x'], [9, 6, 8])
  assert Batched.calls == [[9, 6, 8]]

"""K steps per compiled call (lax.scan) compute what K separate calls compute."""

import jax
import numpy as np
import pytest

import disttrain
from disttrain.config import MeshConfig
from disttrain.errors import ConfigError
from disttrain.parallel import mesh as mesh_lib
from tests.helpers import devices, make_config, to_numpy


@pytest.mark.parametrize('step_mode', ['jit', pytest.param('shard_map', marks=pytest.mark.slow)])
def test_steps_per_dispatch_matches_one_step_per_call(step_mode, tmp_path):
  common = dict(mesh__data=8, step_mode=step_mode, num_train_steps=24, log_every_steps=4,
                eval_every_steps=12, checkpoint_every_steps=12, model__hidden=64,
                model__dropout=0.3 if step_mode == 'jit' else 0.0)
  one = disttrain.train(make_config(**common), str(tmp_path / 'k1'), devices=devices(8))
  four = disttrain.train(make_config(steps_per_dispatch=4, **common), str(tmp_path / 'k4'),
                         devices=devices(8))
  assert four.trace_count == 1
  train = lambda r: [(x['step'], x['loss']) for x in r.records if x['split'] == 'train']
  (steps1, losses1), (steps4, losses4) = zip(*train(one)), zip(*train(four))
  assert steps1 == steps4 == tuple(range(4, 25, 4))  # means over the 4 steps before each
  # Same per-step arithmetic; measured bitwise equal here, 1e-6 allows XLA to fuse the scan body.
  np.testing.assert_allclose(losses4, losses1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(to_numpy(four.state.params)),
                  jax.tree.leaves(to_numpy(one.state.params))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cadences_must_be_multiples_of_steps_per_dispatch():
  with pytest.raises(ConfigError, match='log_every_steps=10 is not a multiple of '
                                        'steps_per_dispatch=4'):
    make_config(steps_per_dispatch=4, num_train_steps=40, log_every_steps=10)
  with pytest.raises(ConfigError, match='pmap'):
    make_config(steps_per_dispatch=4, step_mode='pmap', num_train_steps=40, log_every_steps=4)


def test_iterator_positions_are_in_batches_whatever_k():
  from disttrain import data  # pylint: disable=g-import-not-at-top
  from disttrain.data import records, sources  # pylint: disable=g-import-not-at-top
  split = records.Records(sources.build(make_config())['train_data'], 'train', 0)
  mesh = mesh_lib.build(MeshConfig(data=8), jax.devices()[:8])
  sharding = mesh_lib.batch_sharding(mesh)
  four = data.TrainIterator(split, 64, 0, sharding, batches_per_element=4)
  first = next(four)
  assert first[records.ID].shape == (4, 64)
  next(four)
  state = four.get_state()
  assert state['next_batch'] == 8  # two elements of four batches
  one = data.TrainIterator(split, 64, 0, sharding)
  one.set_state(state)
  expected = np.asarray(next(four)[records.ID])[0]  # batch 8, first of the third element
  np.testing.assert_array_equal(np.asarray(next(one)[records.ID]), expected)
  three = data.TrainIterator(split, 64, 0, sharding, batches_per_element=3)
  with pytest.raises(Exception, match='not a multiple of steps_per_dispatch=3'):
    three.set_state(state)


@pytest.mark.parametrize('step_mode', ['jit', pytest.param('pmap', marks=pytest.mark.slow)])
def test_quiet_steps_train_exactly_like_full_ones(step_mode, tmp_path):
  """log_every_steps=1 runs only the full-metrics step; 5 runs the quiet one on 4 of 5 steps.

  The quiet step divides by the static batch size instead of the summed mask (equal here: train
  batches are full), and skips grad_norm and accuracy: the training itself must not change.
  """
  common = dict(mesh__data=8, step_mode=step_mode, num_train_steps=20, eval_every_steps=20,
                model__hidden=32, model__dropout=0.0)
  every = disttrain.train(make_config(log_every_steps=1, **common), str(tmp_path / 'every'),
                          devices=devices(8))
  fifth = disttrain.train(make_config(log_every_steps=5, **common), str(tmp_path / 'fifth'),
                          devices=devices(8))
  assert every.trace_count == fifth.trace_count == 1
  per_step = {r['step']: r for r in every.records if r['split'] == 'train'}
  records = [r for r in fifth.records if r['split'] == 'train']
  assert [r['step'] for r in records] == [5, 10, 15, 20]
  for r in records:
    window = [per_step[s]['loss'] for s in range(r['step'] - 4, r['step'] + 1)]
    # Loss: the mean of the same five per-step losses (float64 mean vs float64 mean of float32s).
    np.testing.assert_allclose(r['loss'], np.mean(window), rtol=1e-6)
    # accuracy and grad_norm: the logged step's own, computed by the same full-metrics step.
    assert r['accuracy'] == per_step[r['step']]['accuracy']
    assert r['grad_norm'] == per_step[r['step']]['grad_norm'] > 0
  for a, b in zip(jax.tree.leaves(to_numpy(fifth.state.params)),
                  jax.tree.leaves(to_numpy(every.state.params))):
    np.testing.assert_array_equal(a, b)  # the same arithmetic, step for step

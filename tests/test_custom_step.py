"""A user-supplied train step (two parameter groups, two optimizers) keeps everything else."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import disttrain
from disttrain.errors import ConfigError
from tests.helpers import devices, make_config, to_numpy


def _group(path, _) -> str:
  return 'head' if jax.tree_util.keystr(path).startswith("['Dense_2']") else 'body'


def two_optimizers():
  """Adam for the body, SGD with momentum for the classifier head."""
  return optax.multi_transform({'body': optax.adam(1e-3), 'head': optax.sgd(0.05, momentum=0.9)},
                               lambda params: jax.tree_util.tree_map_with_path(_group, params))


def alternating_step(ctx: disttrain.StepContext, state, batch):
  """GAN-style alternation: even steps move the body, odd steps the head."""
  grads, sums, count, new_mutable = ctx.loss_and_grads(state, batch)
  labels = jax.tree_util.tree_map_with_path(_group, grads)
  head_turn = state.step % 2 == 1
  grads = jax.tree.map(lambda g, group: jnp.where(head_turn == (group == 'head'), g, 0.0),
                       grads, labels)
  state, metrics = ctx.apply_gradients(state, grads, sums, count, new_mutable)
  metrics['head_turn'] = head_turn.astype(jnp.float32)
  return state, metrics


def _run(workdir, n, steps, **overrides):
  cfg = make_config(num_train_steps=steps, log_every_steps=1, checkpoint_every_steps=10,
                    model__hidden=64, **overrides)
  return disttrain.train(cfg, str(workdir), devices=devices(n), tx=two_optimizers(),
                         train_step=alternating_step)


def _losses(result):
  return {r['step']: r['loss'] for r in result.records if r['split'] == 'train'}


def test_custom_step_trains_sharded_and_matches_one_device(tmp_path):
  fsdp = _run(tmp_path / 'fsdp', 8, 20, mesh__data=1, mesh__fsdp=8, sharding='fsdp',
              fsdp_min_size=1024)
  single = _run(tmp_path / 'one', 1, 20, mesh__data=1)
  a, b = _losses(fsdp), _losses(single)
  np.testing.assert_allclose([a[s] for s in range(1, 11)], [b[s] for s in range(1, 11)],
                             rtol=1e-4)
  assert a[20] < 0.6 * a[1], 'the custom step should learn'
  turns = [r['head_turn'] for r in fsdp.records if r['split'] == 'train']
  assert turns[:4] == [0.0, 1.0, 0.0, 1.0]
  assert fsdp.state.params['Dense_1']['kernel'].addressable_shards[0].data.shape == (64 // 8, 64)


@pytest.mark.slow
def test_custom_step_resumes_exactly(tmp_path):
  straight = _run(tmp_path / 'straight', 8, 20, mesh__data=8)
  _run(tmp_path / 'split', 8, 10, mesh__data=8)
  resumed = _run(tmp_path / 'split', 8, 20, mesh__data=8)
  expected, actual = _losses(straight), _losses(resumed)
  assert sorted(actual) == list(range(11, 21))
  assert all(actual[s] == expected[s] for s in actual)
  for x, y in zip(jax.tree.leaves(to_numpy(resumed.state.opt_state)),
                  jax.tree.leaves(to_numpy(straight.state.opt_state))):
    np.testing.assert_array_equal(x, y)  # both optimizers' states, bitwise


def test_custom_step_needs_jit_style(tmp_path):
  with pytest.raises(ConfigError, match='step_mode=jit'):
    _run(tmp_path, 8, 4, mesh__data=8, step_mode='shard_map', model__dropout=0.0)

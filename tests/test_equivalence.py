"""Every layout computes what 1 device computes, on the same global batches (seed-004 MLP).

Tolerances are physical, not tuned: one step from the same state differs only by float
reassociation of the cross-device sums (~1e-7 relative), so rtol 1e-5 / atol 1e-6. Over a run,
training amplifies that difference (measured here with a hand-written loop on digits, Adam, no
dropout: <= 3e-5 over 10 steps, up to 4e-3 by step 30; with 2026-11-27's packages, numpy 2.5.5
and scikit-learn 1.9.1, the dropout-free run reached 1.0e-4 at step 10 on every 8-device layout,
jit fsdp8 included, where the loss is down to 0.13), so per-step losses get rtol 2e-4 for the
first 10 steps and 1e-2 for all 30; tighter long-run bounds would not be physical.

jit layouts run with dropout on: the dropout mask is drawn for the global batch from
fold_in(rng, step) and threefry is partitionable, so it does not depend on the layout.
shard_map and pmap draw per-device masks (key folded with the device index), so they are
compared with dropout off; BatchNorm stays on and must use global-batch statistics.

New parameters after Adam's first step: the update is lr * g / (|g| + eps), eps = 1e-8, i.e.
about lr * sign(g). Where |g| is at the reassociation noise floor (measured: a handful of the
262,144 Dense_1 gradients are ~2.5e-8 while max |g| = 0.05, and 1 vs 8 devices give 2.55e-8 vs
2.84e-8) that ratio moves by a few percent and the new parameter by ~2e-5. So new parameters are
held to rtol 1e-5 / atol 1e-6 wherever |g| > 1e-6, and elsewhere only to Adam's step bound
(|difference| <= 2 lr), and elements that differ beyond the strict tolerance must stay rare
(< 0.1% of all parameters).
"""

import jax
import numpy as np
import pytest

import disttrain
from disttrain import data
from tests.helpers import LAYOUTS, assert_trees_close, devices, make_config, to_numpy

DROPOUT_INVARIANT = ('replicate8', 'fsdp8', 'data4_tensor2')


def _dropout(layout: str) -> float:
  return 0.3 if layout in DROPOUT_INVARIANT else 0.0


def _one_step(cfg, n_devices: int):
  """Loss, gradients and new params after one step from the seed's initial state."""
  run = disttrain.setup(cfg, devices=devices(n_devices))
  step = run.steps
  batch = next(data.TrainIterator(run.train_data, cfg.global_batch_size, cfg.seed,
                                  run.batch_sharding))
  device_state = step.place(run.state)
  grads = to_numpy(step.grads(device_state, batch))
  new_state, metrics = step.train(device_state, batch)
  new_state = step.export(new_state)
  return float(metrics['loss']), grads, to_numpy(new_state.params), to_numpy(new_state.mutable)


def _assert_new_params_close(params, ref_params, ref_grads, lr):
  flat_ref = dict(jax.tree_util.tree_flatten_with_path(ref_params)[0])
  flat_grad = dict(jax.tree_util.tree_flatten_with_path(ref_grads)[0])
  loose, total = 0, 0
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    ref, grad = flat_ref[path], flat_grad[path]
    name = jax.tree_util.keystr(path)
    resolved = np.abs(grad) > 1e-6
    np.testing.assert_allclose(p[resolved], ref[resolved], rtol=1e-5, atol=1e-6,
                               err_msg=f'new param {name}')
    assert np.all(np.abs(p - ref)[~resolved] <= 2 * lr), name
    loose += int(np.sum(np.abs(p - ref) > 1e-6 + 1e-5 * np.abs(ref)))
    total += p.size
  assert loose < 1e-3 * total, f'{loose} of {total} new params differ beyond rtol 1e-5'


@pytest.fixture(scope='module')
def one_step_reference():
  """The 1-device step by dropout rate, computed once for every layout that uses it."""
  cache = {}

  def get(dropout: float):
    if dropout not in cache:
      cache[dropout] = _one_step(make_config(mesh__data=1, model__dropout=dropout), 1)
    return cache[dropout]
  return get


@pytest.mark.parametrize('layout', [  # the quick tier: a split state, a split model, pmap
    pytest.param(layout, marks=pytest.mark.slow) if layout in ('replicate8', 'shard_map8')
    else layout for layout in LAYOUTS])
def test_one_step_matches_one_device(layout, one_step_reference):
  overrides, n = LAYOUTS[layout]
  cfg = make_config(**overrides, model__dropout=_dropout(layout))
  loss, grads, params, mutable = _one_step(cfg, n)
  ref_loss, ref_grads, ref_params, ref_mutable = one_step_reference(_dropout(layout))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
  assert_trees_close(grads, ref_grads, 1e-5, 1e-6, 'gradient')
  _assert_new_params_close(params, ref_params, ref_grads, lr=cfg.learning_rate)
  # BatchNorm running statistics: global-batch statistics in every style.
  assert_trees_close(mutable, ref_mutable, 1e-5, 1e-6, 'batch_stats')


def _train_losses(cfg, workdir, n_devices: int = 8) -> list[float]:
  result = disttrain.train(cfg, str(workdir), devices=devices(n_devices))
  assert result.trace_count == 1, f'train step traced {result.trace_count} times'
  return [r['loss'] for r in result.records if r['split'] == 'train']


@pytest.fixture(scope='module')
def reference_losses(tmp_path_factory):
  """30 per-step losses on 1 device, with and without dropout."""
  return {rate: _train_losses(_run_config(rate), tmp_path_factory.mktemp(f'ref{rate}'), 1)
          for rate in (0.0, 0.3)}


def _run_config(dropout: float, **overrides):
  base = {'mesh__data': 1, 'num_train_steps': 30, 'log_every_steps': 1, 'eval_every_steps': 0,
          'model__dropout': dropout}
  base.update(overrides)
  return make_config(**base)


@pytest.mark.parametrize('layout', [  # the quick tier keeps fsdp8: one run, every code path
    layout if layout == 'fsdp8' else pytest.param(layout, marks=pytest.mark.slow)
    for layout in LAYOUTS])
def test_thirty_steps_match_one_device(layout, reference_losses, tmp_path):
  overrides, _ = LAYOUTS[layout]
  rate = _dropout(layout)
  losses = _train_losses(_run_config(rate, **overrides), tmp_path)
  expected = reference_losses[rate]
  assert len(losses) == len(expected) == 30
  np.testing.assert_allclose(losses[:10], expected[:10], rtol=2e-4)
  np.testing.assert_allclose(losses, expected, rtol=1e-2)
  assert losses[-1] < 0.5 * losses[0], 'the model should learn within 30 steps'

"""Global masked averaging and exact eval: sums over valid examples / global valid count."""

import re

import jax
import numpy as np
import pytest

import disttrain
from disttrain.data import sources
from disttrain.data.records import ID, MASK, Records
from disttrain.models.task import Classification
from tests.helpers import devices, make_config, to_numpy

BATCH = 64  # 8 rows per device on 8 devices


def _build(cfg, n):
  run = disttrain.setup(cfg, devices=devices(n))
  return run.train_data, run.model, run.state, run.steps, run.batch_sharding


def _uneven_batch(train):
  """Rows 0-29 masked out: devices 0-2 hold no valid row, device 3 holds 2 of 8."""
  mask = np.ones(BATCH, np.float32)
  mask[:30] = 0.0
  return {**train.read(np.arange(BATCH)), ID: np.arange(BATCH, dtype=np.int32), MASK: mask}


@pytest.mark.parametrize('step_mode', ['jit', 'shard_map', 'pmap'])
def test_uneven_mask_loss_is_global_masked_mean(step_mode):
  cfg = make_config(mesh__data=8, step_mode=step_mode, model__dropout=0.0,
                    global_batch_size=BATCH)
  dataset, model, state, step, sharding = _build(cfg, 8)
  host_batch = _uneven_batch(dataset)
  # Reference on the host: per-example losses of the same forward pass (same BatchNorm batch).
  params = to_numpy(state.params)
  logits, _, _ = model.apply({'params': params, **to_numpy(state.mutable)}, host_batch, train=True,
                          rng=None)
  losses = np.asarray(Classification().per_example(logits, host_batch)['loss'], np.float64)
  mask = host_batch[MASK]
  expected = float(np.sum(losses * mask) / np.sum(mask))
  per_device = [np.sum((losses * mask)[d * 8:(d + 1) * 8]) / np.sum(mask[d * 8:(d + 1) * 8])
                for d in range(8) if np.sum(mask[d * 8:(d + 1) * 8])]
  # The mean of per-device means is measurably different here, so this test can tell them apart.
  assert abs(np.mean(per_device) - expected) > 1e-3

  _, metrics = step.train(step.place(state), jax.device_put(host_batch, sharding))
  np.testing.assert_allclose(float(metrics['loss']), expected, rtol=1e-5)
  assert float(metrics['count']) == 34.0


def _numpy_forward(params, stats, images):
  """The seed-004 MLP in eval mode, in float64 numpy."""
  x = images.reshape(len(images), -1).astype(np.float64)
  for i in range(2):
    dense, bn, st = params[f'Dense_{i}'], params[f'BatchNorm_{i}'], stats[f'BatchNorm_{i}']
    x = np.maximum(x @ dense['kernel'] + dense['bias'], 0.0)
    x = (x - st['mean']) / np.sqrt(st['var'] + 1e-5) * bn['scale'] + bn['bias']
  return x @ params['Dense_2']['kernel'] + params['Dense_2']['bias']


@pytest.mark.parametrize('n_devices', [8, 1])
def test_eval_counts_every_example_once_and_matches_numpy(n_devices, tmp_path):
  # 297 eval examples, batches of 64: the last batch has 41 real rows and 23 padded ones.
  cfg = make_config(mesh__data=n_devices, num_train_steps=20, log_every_steps=20,
                    eval_batch_size=BATCH)
  result = disttrain.train(cfg, str(tmp_path), devices=devices(n_devices))
  final = [r for r in result.records if r['split'] == 'eval'][-1]
  split = sources.build(cfg)['eval_data']
  logits = _numpy_forward(to_numpy(result.state.params),
                          to_numpy(result.state.mutable)['batch_stats'], split['image'])
  correct = int(np.sum(np.argmax(logits, -1) == split['label']))
  assert final['num_examples'] == len(split['label']) == 297
  assert round(final['accuracy'] * 297) == correct  # exact count of correct examples
  assert final['accuracy'] == pytest.approx(correct / 297, abs=1e-7)
  log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                     keepdims=True)) - logits.max(-1, keepdims=True)
  expected_loss = -np.mean(log_probs[np.arange(297), split['label']])
  np.testing.assert_allclose(final['loss'], expected_loss, rtol=1e-4)


@pytest.mark.parametrize('step_mode', ['jit', 'pmap'])
def test_an_eval_set_smaller_than_one_device_s_rows_is_padded_and_counted(step_mode):
  """3 eval examples in batches of 64 on 8 devices: device 0 holds them with 5 padding rows,
  devices 1-7 padding only; the eval counts the 3 and matches numpy."""
  cfg = make_config(mesh__data=8, step_mode=step_mode, eval_batch_size=BATCH)
  small = {k: v[:3] for k, v in sources.build(cfg)['eval_data'].items()}
  run = disttrain.setup(cfg, devices=devices(8), eval_data=small)
  result = disttrain.evaluate(run.steps, run.state, run.eval_data['eval'], cfg.eval_batch,
                              run.batch_sharding)
  logits = _numpy_forward(to_numpy(run.state.params), to_numpy(run.state.mutable)['batch_stats'],
                          small['image'])
  assert result['num_examples'] == 3
  assert result['accuracy'] == pytest.approx(np.mean(np.argmax(logits, -1) == small['label']))
  log_probs = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
  np.testing.assert_allclose(result['loss'], -np.mean(log_probs[np.arange(3), small['label']]),
                             rtol=1e-4)


def test_padding_rows_a_model_turns_into_nan_count_for_nothing(tmp_path):
  """A cosine classifier (x / |x|): the all-zero padding rows give NaN, and NaN x mask 0 is NaN,
  so 37 eval examples in batches of 16 reported loss nan. 37 rows equal their first 32 and the
  last 5 scored alone, summed by count."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  model = disttrain.FunctionalModel(
      lambda rng, x: {'w': jax.random.normal(rng, (x.shape[-1], 2))},
      lambda params, x: x / jnp.linalg.norm(x, axis=-1, keepdims=True) @ params['w'],
      input_key='x')
  rng = np.random.default_rng(0)
  data = {'x': rng.standard_normal((37, 8)).astype(np.float32),
          'y': (np.arange(37) % 2).astype(np.int32)}
  cfg = make_config(global_batch_size=16, num_train_steps=1)
  run = disttrain.setup(cfg, devices=devices(1), model=model,
                        task=Classification(label_key='y'), train_data=data, eval_data=data)
  score = lambda rows: disttrain.evaluate(run.steps, run.state, Records(
      {k: v[rows] for k, v in data.items()}, 'eval', 0), 16, run.batch_sharding)
  whole, head, tail = score(slice(None)), score(slice(0, 32)), score(slice(32, None))
  assert np.isfinite(whole['loss']) and whole['num_examples'] == 37
  np.testing.assert_allclose(whole['loss'], (32 * head['loss'] + 5 * tail['loss']) / 37,
                             rtol=1e-5)


def test_an_eval_set_the_model_cannot_take_is_refused_at_setup():
  """Other feature counts or a float label passed setup (same field names) and failed with a
  traceback at the first eval, after training up to it."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  model = disttrain.FunctionalModel(lambda rng, x: {'w': jnp.zeros((x.shape[-1], 2))},
                                    lambda params, x: x @ params['w'], input_key='x')
  train = {'x': np.zeros((32, 8), np.float32), 'y': np.zeros(32, np.int32)}
  for field, value, said in [('x', np.zeros((16, 7), np.float32), 'x float32[7]'),
                             ('y', np.zeros(16, np.float32), 'y float32[]')]:
    with pytest.raises(disttrain.errors.DataError, match=r'the eval data \(.*' + re.escape(said) +
                       r'.* does not run through the model trained on x float32\[8\], y int32\[\]'):
      disttrain.setup(make_config(global_batch_size=16), devices=devices(1), model=model,
                      task=Classification(label_key='y'), train_data=train,
                      eval_data={**{k: v[:16] for k, v in train.items()}, field: value})


def test_labels_the_task_cannot_read_are_one_line():
  """A label field of another name (a KeyError traceback while compiling), labels of [N, 1] as
  sklearn gives them (a take_along_axis ValueError), float labels (a dtype TypeError)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  model = disttrain.FunctionalModel(lambda rng, x: {'w': jnp.zeros((x.shape[-1], 2))},
                                    lambda params, x: x @ params['w'], input_key='x')
  x = np.zeros((32, 8), np.float32)
  for data, said in [({'x': x, 'target': np.zeros(32, np.int32)},
                      "reads its targets from batch field 'y', but the data has ['target', 'x']"),
                     ({'x': x, 'y': np.zeros((32, 1), np.int32)},
                      "field 'y' holds the targets as int32[16, 1], but the model gives [16] rows"),
                     ({'x': x, 'y': np.zeros(32, np.float32)}, 'as float32[16], but')]:
    run = disttrain.setup(make_config(global_batch_size=16), devices=devices(1), model=model,
                          task=Classification(label_key='y'), train_data=data, eval_data=data)
    batch = {**{k: v[:16] for k, v in data.items()}, MASK: np.ones(16, np.float32)}
    with pytest.raises(disttrain.errors.DataError, match=re.escape(said)):
      run.steps.train(run.steps.place(run.state), batch)

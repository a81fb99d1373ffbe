"""Each model front end (functional, NNX, Keras) behind the one protocol, checked by direct math.

Layout comparisons use 3 steps and rtol 1e-5: one step differs from 1 device only by float
reassociation (~1e-7, see test_equivalence.py), and 3 steps leave no room for divergence.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import disttrain
from disttrain import data, models
from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.models import FunctionalModel, LinenModel, NNXModel
from disttrain.models.mlp import MnistMLP, jax_mlp_apply, jax_mlp_init
from disttrain.models.nnx_mlp import NnxMLP
from disttrain.models.task import Classification, PerDeviceLoss
from disttrain.parallel import mesh as mesh_lib, optim, sharding as sharding_lib, state as state_lib
from tests.helpers import devices, make_config, to_numpy

# Keras picks its backend on first import; disttrain.models.keras sets the same default, but the
# guards below import keras first.
os.environ.setdefault('KERAS_BACKEND', 'jax')


def _first_step(cfg, model, n_devices: int = 1):
  """(initial state, batch, metrics) of one train step, all as numpy."""
  run = disttrain.setup(cfg, model=model, devices=devices(n_devices))
  batch = next(data.TrainIterator(run.train_data, cfg.global_batch_size, cfg.seed,
                                  run.batch_sharding))
  initial = to_numpy(run.state)  # before the step donates it
  new_state, metrics = run.steps.train(run.steps.place(run.state), batch)
  return initial, to_numpy(batch), to_numpy(run.steps.export(new_state)), to_numpy(metrics)


def _losses(cfg, model, workdir, n_devices: int) -> list[float]:
  result = disttrain.train(cfg, str(workdir), model=model, devices=devices(n_devices))
  assert result.trace_count == 1
  return [r['loss'] for r in result.records if r['split'] == 'train']


def _three_steps(**overrides):
  return make_config(num_train_steps=3, log_every_steps=1, model__dropout=0.0, **overrides)


# --- plain functions -------------------------------------------------------------------------

_DIGITS_SPEC = {'image': jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32)}


def test_functional_logical_specs_split_hidden_over_tensor():
  cfg = make_config(mesh__data=4, mesh__tensor=2)  # logical_rules: hidden -> tensor
  mesh = mesh_lib.build(cfg.mesh, devices(8))
  model = models.build(ModelConfig(name='jax_mlp', hidden=64))
  tx, _ = optim.build(cfg)
  state, lay = state_lib.create(model, tx, _DIGITS_SPEC, cfg, mesh)
  specs = sharding_lib.spec_lists(lay.param_specs)
  assert specs['0/0'] == ['tensor', None] and specs['1/0'] == ['tensor', None]  # w [out, in]
  assert specs['2/0'] == [None, None]  # classes are not split
  assert state.params[1][0].addressable_shards[0].data.shape == (32, 64)


def test_functional_logical_specs_must_match_the_params():
  model = FunctionalModel(jax_mlp_init, jax_mlp_apply, logical=[('hidden',)])
  with pytest.raises(ConfigError, match='logical specs have structure'):
    model.logical_specs(_DIGITS_SPEC)


# --- Flax NNX --------------------------------------------------------------------------------

def _nnx_mlp(hidden=32, dropout=0.3) -> NNXModel:
  return NNXModel(lambda rngs, shape: NnxMLP(shape, 10, hidden, dropout, rngs=rngs))


def test_nnx_dropout_keys_come_from_the_call_and_no_rng_is_stored():
  model, x = _nnx_mlp(), {'image': jax.random.uniform(jax.random.key(1), (16, 8, 8, 1))}
  variables = model.init(jax.random.key(0), x)
  assert set(variables) == {'params', 'batch_stats'}  # no RngKey / RngCount in the state
  call = jax.jit(lambda v, r: model.apply(v, x, train=True, rng=r)[0])
  same, other = call(variables, jax.random.key(2)), call(variables, jax.random.key(3))
  np.testing.assert_array_equal(same, call(variables, jax.random.key(2)))
  assert np.abs(same - other).max() > 1e-3
  out, new, _ = model.apply(variables, x, train=False, rng=None)
  assert new == {}
  again, _, _ = model.apply(variables, x, train=False, rng=jax.random.key(9))
  np.testing.assert_array_equal(out, again)


def test_nnx_model_computes_what_the_linen_model_computes():
  # Same weights in both (renamed): outputs and BatchNorm statistics must agree in train mode.
  x = {'image': jax.random.uniform(jax.random.key(1), (16, 8, 8, 1))}
  linen = LinenModel(MnistMLP(num_classes=10, hidden=32, dropout=0.0))
  variables = linen.init(jax.random.key(0), x)
  names = {'dense_0': 'Dense_0', 'dense_1': 'Dense_1', 'head': 'Dense_2', 'norm_0': 'BatchNorm_0',
           'norm_1': 'BatchNorm_1'}
  nnx_vars = {'params': {k: variables['params'][v] for k, v in names.items()},
              'batch_stats': {k: variables['batch_stats'][names[k]] for k in ('norm_0', 'norm_1')}}
  out, stats, _ = linen.apply(variables, x, train=True, rng=None)
  nnx_out, nnx_stats, _ = _nnx_mlp(dropout=0.0).apply(nnx_vars, x, train=True, rng=None)
  np.testing.assert_allclose(nnx_out, out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(nnx_stats['batch_stats']['norm_1']['var'],
                             stats['batch_stats']['BatchNorm_1']['var'], rtol=1e-5)


def test_nnx_shard_map_uses_global_batch_statistics(tmp_path):
  ref = _losses(_three_steps(mesh__data=1, model__name='nnx_mlp', model__hidden=64),
                None, tmp_path / 'one', 1)
  cfg = _three_steps(mesh__data=8, step_mode='shard_map', model__name='nnx_mlp', model__hidden=64)
  np.testing.assert_allclose(_losses(cfg, None, tmp_path / 'eight', 8), ref, rtol=1e-5)


class _RunningMean(nnx.Module):
  """A module with mutable state and no axis_name: shard_map would keep per-device means."""

  def __init__(self, input_shape, rngs):
    self.dense = nnx.Linear(int(np.prod(input_shape)), 10, rngs=rngs)
    self.mean = nnx.BatchStat(jnp.zeros((10,)))

  def __call__(self, x):
    y = self.dense(x.reshape(x.shape[0], -1))
    self.mean.value = 0.9 * self.mean.value + 0.1 * y.mean(0)
    return y


def test_nnx_state_without_axis_name_is_refused_in_shard_map(tmp_path):
  cfg = _three_steps(mesh__data=8, step_mode='shard_map')
  model = NNXModel(lambda rngs, shape: _RunningMean(shape, rngs))
  with pytest.raises(ConfigError, match="_RunningMean at the top level has mutable state 'mean'"):
    disttrain.train(cfg, str(tmp_path), model=model, devices=devices(8))


# --- Keras 3 ---------------------------------------------------------------------------------

def _keras_model(layers_fn, **kwargs):
  keras = pytest.importorskip('keras')
  from disttrain.models.keras import KerasModel  # pylint: disable=g-import-not-at-top

  def build(shape):
    inputs = keras.Input(shape=shape)
    x = keras.layers.Reshape((int(np.prod(shape)),))(inputs)
    return keras.Model(inputs, layers_fn(keras, x))
  return KerasModel(build, **kwargs)


def test_keras_dropout_seeds_come_from_the_call_and_are_not_stored():
  model = _keras_model(_sum_loss_layers(0.5))
  x = {'image': jax.random.uniform(jax.random.key(1), (16, 8, 8, 1))}
  variables = model.init(jax.random.key(0), x)
  assert set(variables) == {'params'}  # the Dropout's seed-generator state is not kept
  call = jax.jit(lambda r: model.apply(variables, x, train=True, rng=r)[0])
  np.testing.assert_array_equal(call(jax.random.key(2)), call(jax.random.key(2)))
  assert np.abs(call(jax.random.key(2)) - call(jax.random.key(3))).max() > 1e-3


def test_keras_add_loss_changes_the_loss_by_exactly_its_sum():
  pytest.importorskip('keras')
  from disttrain.models import keras_mlp  # pylint: disable=g-import-not-at-top
  initial, batch, _, metrics = _first_step(make_config(mesh__data=1), keras_mlp.model(10))
  p = initial.params
  x = batch['image'].reshape(len(batch['label']), -1)
  h1 = np.maximum(x @ p['dense_1/kernel'] + p['dense_1/bias'], 0)
  h2 = np.maximum(h1 @ p['dense_2/kernel'] + p['dense_2/bias'], 0)
  logits = h2 @ p['predictions/kernel'] + p['predictions/bias']
  ce = np.mean(optax_ce(logits, batch['label']))
  activity = 1e-2 * np.mean(h1.sum(axis=1))
  assert activity > 1e-3 * ce  # large enough that leaving it out would fail the check below
  np.testing.assert_allclose(metrics['loss'], ce + activity, rtol=1e-5)


class _SowsALoss(nn.Module):
  """Sows an auxiliary loss (a mean over the call's rows, as a router's balance loss is)."""

  @nn.compact
  def __call__(self, x, train):
    del train
    h = nn.Dense(16)(x.reshape(x.shape[0], -1))
    self.sow('losses', 'aux', 0.1 * jnp.mean(jnp.square(h)))
    return nn.Dense(10)(nn.relu(h))


def test_linen_sown_losses_are_the_model_loss_on_any_layout(tmp_path):
  """The 'losses' collection is summed into the loss (not kept as state), and shard_map's
  per-device shares of it add up to 1 device's loss."""
  model = LinenModel(_SowsALoss())
  initial, batch, _, metrics = _first_step(make_config(mesh__data=1), model)
  assert not initial.mutable  # sown values are not state
  p = initial.params
  x = batch['image'].reshape(len(batch['label']), -1)
  h = x @ p['Dense_0']['kernel'] + p['Dense_0']['bias']
  logits = np.maximum(h, 0) @ p['Dense_1']['kernel'] + p['Dense_1']['bias']
  ce, aux = np.mean(optax_ce(logits, batch['label'])), 0.1 * np.mean(h ** 2)
  assert aux > 1e-2 * ce  # large enough that leaving it out would fail the check below
  np.testing.assert_allclose(metrics['loss'], ce + aux, rtol=1e-5)
  ref = _losses(_three_steps(mesh__data=1), model, tmp_path / 'one', 1)
  shard8 = _losses(_three_steps(mesh__data=8, step_mode='shard_map'), model, tmp_path / 's8', 8)
  np.testing.assert_allclose(shard8, ref, rtol=1e-5)


def optax_ce(logits, labels):
  logits = logits - logits.max(axis=1, keepdims=True)
  return np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(len(labels)), labels]


def test_keras_batch_norm_statistics_update():
  model = _keras_model(lambda keras, x: keras.layers.Dense(10, name='head')(
      keras.layers.BatchNormalization(momentum=0.9, name='norm')(
          keras.layers.Dense(16, name='dense')(x))))
  initial, batch, new, _ = _first_step(make_config(mesh__data=1), model)
  x = batch['image'].reshape(len(batch['label']), -1)
  h = x @ initial.params['dense/kernel'] + initial.params['dense/bias']
  moving = new.mutable['non_trainable']
  np.testing.assert_allclose(moving['norm/moving_mean'], 0.1 * h.mean(axis=0), rtol=1e-4,
                             atol=1e-6)
  assert np.abs(moving['norm/moving_mean']).max() > 1e-3


def _sum_loss_layers(dropout: float):
  def layers(keras, x):
    class SumLoss(keras.layers.Layer):  # seed 000's add_loss: a raw sum over rows and features
      def call(self, inputs):
        self.add_loss(1e-3 * keras.ops.sum(inputs))
        return inputs
    x = SumLoss()(keras.layers.Dense(32, activation='relu', name='dense')(x))
    return keras.layers.Dense(10, name='head')(keras.layers.Dropout(dropout)(x))
  return layers


@pytest.mark.slow
def test_keras_dropout_and_summed_losses_match_one_device(tmp_path):
  # jit: Keras dropout draws from seeds derived from the step's key, so 8 devices draw the
  # global mask of 1 device. shard_map: per-device masks differ, so dropout is off there; a sum
  # over rows is exact only because the model declares loss_reduction='sum', and in micro-batches
  # too (each micro-batch's sum entered divided by grad_accum_steps: 6.67 -> 4.54 at M=2).
  steps = dict(num_train_steps=3, log_every_steps=1)
  model = _keras_model(_sum_loss_layers(0.3), loss_reduction='sum')
  ref = _losses(make_config(mesh__data=1, **steps), model, tmp_path / 'one', 1)
  jit8 = _losses(make_config(mesh__data=8, **steps), model, tmp_path / 'jit8', 8)
  np.testing.assert_allclose(jit8, ref, rtol=1e-5)
  model = _keras_model(_sum_loss_layers(0.0), loss_reduction='sum')
  ref = _losses(make_config(mesh__data=1, **steps), model, tmp_path / 'one_nodrop', 1)
  shard8 = _losses(make_config(mesh__data=8, step_mode='shard_map', grad_accum_steps=2, **steps),
                   model, tmp_path / 'shard8', 8)
  np.testing.assert_allclose(shard8, ref, rtol=1e-5)
  jit1 = _losses(make_config(mesh__data=1, grad_accum_steps=2, **steps), model,
                 tmp_path / 'accum', 1)
  np.testing.assert_allclose(jit1, ref, rtol=1e-5)


def test_keras_losses_of_unknown_reduction_and_batch_norm_are_refused_in_shard_map(tmp_path):
  cfg = _three_steps(mesh__data=8, step_mode='shard_map')
  unknown = _keras_model(_sum_loss_layers(0.0))
  with pytest.raises(ConfigError, match='loss_reduction is None'):
    disttrain.train(cfg, str(tmp_path / 'a'), model=unknown, devices=devices(8))
  norm = _keras_model(lambda keras, x: keras.layers.BatchNormalization()(x))
  with pytest.raises(ConfigError, match='BatchNormalization'):
    disttrain.train(cfg, str(tmp_path / 'b'), model=norm, devices=devices(8))


def test_keras_task_matches_classification():
  keras = pytest.importorskip('keras')
  from disttrain.models.keras import KerasTask  # pylint: disable=g-import-not-at-top
  task = KerasTask(keras.losses.CategoricalCrossentropy(from_logits=True, reduction=None),
                   {'accuracy': keras.metrics.categorical_accuracy}, num_classes=10)
  logits = jax.random.normal(jax.random.key(0), (32, 10))
  batch = {'label': jax.random.randint(jax.random.key(1), (32,), 0, 10)}
  got, want = task.per_example(logits, batch), Classification().per_example(logits, batch)
  for name in ('loss', 'accuracy'):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)


# --- tasks -----------------------------------------------------------------------------------

def test_per_device_loss_is_the_mean_over_each_row_block():
  logits = jax.random.normal(jax.random.key(0), (16, 10))
  batch = {'label': jax.random.randint(jax.random.key(1), (16,), 0, 10), '_mask': jnp.ones(16)}
  values = PerDeviceLoss(Classification(), 4).per_example(logits, batch)
  loss = np.asarray(values['loss'])
  for d in range(4):  # what the step reports: sum over the batch / global count
    np.testing.assert_allclose(np.sum(values[f'loss_device_{d}']) / 16,
                               loss[4 * d:4 * d + 4].mean(), rtol=1e-6)

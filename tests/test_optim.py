"""Optimizer realism, each feature against the optax chain written by hand.

Both sides get the same gradients (a tiny Llama's, on 5 batches of byte text), so the only
difference is the optimizer: parameters after 5 steps agree to rtol 1e-6 (measured: bitwise).
The hand-written weight-decay mask decays exactly the Dense kernels (`.../kernel`): not the norms,
not the token embedding.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import disttrain
from disttrain import data
from disttrain.errors import ConfigError
from disttrain.parallel import optim
from disttrain.parallel import sharding as sharding_lib
from tests import helpers
from tests.conftest import ROOT
from tests.helpers import devices

LR, STEPS = 1e-2, 5


def _config(**overrides) -> disttrain.Config:
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  base = {'model.num_layers': 2, 'model.hidden': 32, 'model.num_heads': 2,
          'model.num_kv_heads': 1, 'model.mlp_dim': 64, 'data.seq_len': 16,
          'global_batch_size': 8, 'data.text.bytes': 20_000, 'data.eval_examples': 16,
          'eval_batch_size': 16, 'mesh.data': 1, 'learning_rate': LR, 'warmup_steps': 0,
          'lr_schedule': 'constant', 'num_train_steps': STEPS, 'weight_decay': 0.0,
          'optimizer': 'adam', 'eval_every_steps': 0}
  return disttrain.from_config_dict(helpers.override(cd, {**base, **overrides}))


@pytest.fixture(scope='module')
def problem():
  """(initial params, 5 gradients): the same for every optimizer."""
  cfg = _config()
  run = disttrain.setup(cfg, devices=devices(1))
  it = data.TrainIterator(run.train_data, cfg.global_batch_size, cfg.seed, run.batch_sharding)
  grads = [jax.device_get(run.steps.grads(run.state, next(it))) for _ in range(STEPS)]
  it.close()
  return jax.device_get(run.state.params), grads


def _kernels(params):
  """The hand-written decay mask: Dense kernels only."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: jax.tree_util.keystr(path).endswith("['kernel']"), params)


def _apply(tx, params, grads):
  state = tx.init(params)
  for g in grads:
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


FEATURES = {
    'clip_adamw_mask': (dict(optimizer='adamw', weight_decay=0.1, grad_clip_norm=0.05),
                        lambda p: optax.chain(optax.clip_by_global_norm(0.05),
                                              optax.adamw(LR, weight_decay=0.1, mask=_kernels(p)))),
    'lion': (dict(optimizer='lion', weight_decay=0.3),
             lambda p: optax.lion(LR, b1=0.9, b2=0.99, weight_decay=0.3, mask=_kernels(p))),
    # The decay scaled by the learning rate, as AdamW's (optax's adafactor adds it unscaled).
    'adafactor': (dict(optimizer='adafactor', weight_decay=0.01),
                  lambda p: optax.chain(optax.adafactor(LR), optax.add_decayed_weights(
                      -LR * 0.01, mask=_kernels(p)))),
    'adam_bf16_mu_b2': (dict(optimizer='adam', mu_dtype='bfloat16', b2=0.95),
                        lambda p: optax.adam(LR, b2=0.95, mu_dtype=jnp.bfloat16)),
    'sgd_momentum': (dict(optimizer='sgd', momentum=0.9), lambda p: optax.sgd(LR, 0.9)),
}


@pytest.mark.parametrize('feature', [  # the heaviest (a global-norm clip) in the whole suite only
    pytest.param(f, marks=pytest.mark.slow) if f == 'clip_adamw_mask' else f for f in FEATURES])
def test_optimizer_equals_the_hand_written_chain(problem, feature):
  params, grads = problem
  overrides, hand = FEATURES[feature]
  ours, our_state = _apply(optim.build(_config(**overrides))[0], params, grads)
  theirs, _ = _apply(hand(params), params, grads)
  helpers.assert_trees_close(ours, theirs, 1e-6, 0, f'{feature} params')
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(ours),
                                                          jax.tree.leaves(params)))
  assert moved > 1e-3, 'the parameters must have moved'
  if feature == 'adam_bf16_mu_b2':
    mu = our_state[0].mu
    assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype(jnp.bfloat16)}


def test_decay_mask_leaves_out_norms_biases_and_embeddings():
  cfg = _config(optimizer='adamw', weight_decay=0.1)
  run = disttrain.setup(cfg, devices=devices(1))
  paths = optim.decayed_paths(cfg, run.state.params)
  assert paths == sorted(p for p in paths)
  assert set(paths) == {'blocks/attention/key/kernel', 'blocks/attention/out/kernel',
                        'blocks/attention/query/kernel', 'blocks/attention/value/kernel',
                        'blocks/mlp/down/kernel', 'blocks/mlp/gate/kernel', 'blocks/mlp/up/kernel'}
  with_embeddings = _config(optimizer='adamw', weight_decay=0.1, weight_decay_embeddings=True)
  assert 'embed' in optim.decayed_paths(with_embeddings, run.state.params)


def _reference_lr(step: int, kind: str, peak=1.0, warmup=10, total=100, ratio=0.1,
                  fraction=0.2) -> float:
  """The schedules written out: linear warm-up from 0, then cosine or linear to ratio x peak, or
  constant until the last `fraction` of the run, which decays linearly to ratio x peak."""
  if step < warmup:
    return peak * step / warmup
  t, span = step - warmup, total - warmup
  if kind == 'cosine':
    return peak * (ratio + (1 - ratio) * 0.5 * (1 + np.cos(np.pi * min(t, span) / span)))
  if kind == 'linear':
    return peak + (ratio * peak - peak) * min(t, span) / span
  decay = min(round(fraction * total), span)  # what warm-up leaves, at most
  return peak if t < span - decay else peak + (ratio * peak - peak) * min(
      t - (span - decay), decay) / decay


@pytest.mark.parametrize('kind,fraction', [('cosine', 0.2), ('linear', 0.2), ('wsd', 0.2),
                                           ('wsd', 0.95)])
def test_schedules_warm_up_and_end_at_the_minimum_ratio(kind, fraction):
  """wsd 0.95: a decay longer than warm-up leaves starts after warm-up (it ended at 0.15)."""
  cfg = _config(lr_schedule=kind, learning_rate=1.0, warmup_steps=10, num_train_steps=100,
                min_lr_ratio=0.1, wsd_decay_fraction=fraction)
  schedule = optim.schedule(cfg)
  np.testing.assert_allclose([float(schedule(s)) for s in range(101)],
                             [_reference_lr(s, kind, fraction=fraction) for s in range(101)],
                             rtol=1e-6, atol=1e-7)
  assert abs(float(schedule(100)) - 0.1) < 1e-6


def test_ema_equals_the_running_average_written_out(problem):
  params, grads = problem
  tx, _ = optim.build(_config(ema_decay=0.9))
  state, current = tx.init(params), params
  expected = jax.tree.map(np.asarray, params)
  for g in grads:
    updates, state = tx.update(g, state, current)
    current = optax.apply_updates(current, updates)
    expected = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * np.asarray(p), expected, current)
  helpers.assert_trees_close(optim.ema_params(state), expected, 1e-6, 1e-7, 'ema')


@pytest.mark.slow
def test_ema_checkpoints_resume_bitwise_and_evals_use_it(tmp_path):
  """10 steps straight vs 5 + a relaunch to 10 in the same workdir: parameters and their moving
  average equal bit for bit; evals report the average's loss."""
  common = dict(ema_decay=0.8, num_train_steps=10, log_every_steps=1, eval_every_steps=5,
                mesh__data=8)
  straight = disttrain.train(_config(**common), str(tmp_path / 'a'), devices=devices(8))
  disttrain.train(_config(**{**common, 'num_train_steps': 5}), str(tmp_path / 'b'),
                  devices=devices(8))
  resumed = disttrain.train(_config(**common), str(tmp_path / 'b'), devices=devices(8))
  for tree in (lambda s: s.params, lambda s: optim.ema_params(s.opt_state)):
    for a, b in zip(jax.tree.leaves(tree(straight.state)), jax.tree.leaves(tree(resumed.state))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  run = disttrain.setup(_config(**common), devices=devices(8))
  ema_state = straight.state.replace(params=optim.ema_params(straight.state.opt_state))
  for state, matches in ((ema_state, True), (straight.state, False)):
    loss = disttrain.evaluate(run.steps, state, run.eval_data['eval'], 16,
                              run.batch_sharding)['loss']
    assert np.isclose(loss, straight.records[-1]['loss'], rtol=1e-6) == matches
  info = json.loads((tmp_path / 'a' / 'run.json').read_text())
  assert info['weight_decay_paths'] == []  # adam: no decay


@pytest.mark.slow
def test_records_keep_the_gradient_norm_before_clipping(tmp_path):
  """sgd with lr 1 and clip 1e-3: every step moves the parameters by exactly 1e-3 (global
  norm), while the records report the raw gradient norm, far above it."""
  cfg = _config(optimizer='sgd', learning_rate=1.0, grad_clip_norm=1e-3, num_train_steps=1,
                log_every_steps=1)
  run = disttrain.setup(cfg, devices=devices(1))
  before = jax.device_get(run.state.params)
  result = disttrain.train(cfg, str(tmp_path), devices=devices(1))
  moved = optax.tree.norm(jax.tree.map(lambda a, b: a - b, jax.device_get(result.state.params),
                                       before))
  np.testing.assert_allclose(float(moved), 1e-3, rtol=1e-4)
  assert result.records[0]['grad_norm'] > 0.1


# Muon's matrices in the tiny Llama, written out: (reduction axes, output axes) of each kernel
# [layers, ...], counted from the front; axis 0, the scan's layers, is a batch of matrices.
_MUON_AXES = {'query': ((1,), (2, 3)), 'key': ((1,), (2, 3)), 'value': ((1,), (2, 3)),
              'out': ((1, 2), (3,)), 'gate': ((1,), (2,)), 'up': ((1,), (2,)),
              'down': ((1,), (2,))}


def _muon_name(path) -> str | None:
  """The kernel's module name ('query') where Muon updates it, else None (AdamW)."""
  keys = [k.key for k in path]
  return keys[-2] if keys[-1] == 'kernel' and keys[-2] in _MUON_AXES else None


def _hand_muon(lr, adam_lr, weight_decay, b2, clip):
  """Muon written from optax's public pieces: momentum orthogonalised per layer, scaled by
  sqrt(max(1, fan_out / fan_in)) (Keller Jordan's), decayed, times lr; AdamW (with the Nesterov
  momentum optax's muon gives it, undecayed) on everything else, at adam_lr."""
  dims = lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, _: optax.contrib.MuonDimensionNumbers(*_MUON_AXES[_muon_name(path)]), tree)

  def width(updates, state, params=None):
    del params
    def scale(path, u):
      reduction, output = _MUON_AXES[_muon_name(path)]
      fan_in, fan_out = (np.prod([u.shape[a] for a in axes]) for axes in (reduction, output))
      return u * np.sqrt(max(1.0, fan_out / fan_in))
    return jax.tree_util.tree_map_with_path(scale, updates), state

  muon = optax.chain(optax.contrib.scale_by_muon(weight_dimension_numbers=dims),
                     optax.GradientTransformation(lambda _: optax.EmptyState(), width),
                     optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(lr))
  adam = optax.adamw(adam_lr, b1=0.9, b2=b2, weight_decay=0.0, nesterov=True)
  labels = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: 'muon' if _muon_name(path) else 'adam', params)
  return optax.chain(optax.clip_by_global_norm(clip),
                     optax.multi_transform({'muon': muon, 'adam': adam}, labels))


def _apply_jitted(tx, params, grads):
  state, update = tx.init(params), jax.jit(tx.update)
  for g in grads:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_muon_equals_the_hand_written_chain(problem):
  """3 steps of optimizer='muon' (linear decay, its own AdamW peak and b2, decay, clip) on the
  tiny Llama's gradients: each layer's kernel orthogonalised on its own."""
  params, grads = problem
  cfg = _config(optimizer='muon', learning_rate=0.02, adam_learning_rate=LR, weight_decay=0.1,
                b2=0.95, grad_clip_norm=0.05, lr_schedule='linear')
  hand = _hand_muon(optax.linear_schedule(0.02, 0.0, STEPS), optax.linear_schedule(LR, 0.0, STEPS),
                    0.1, 0.95, 0.05)
  ours, theirs = (_apply_jitted(tx, params, grads[:3]) for tx in (optim.build(cfg)[0], hand))
  helpers.assert_trees_close(ours, theirs, 1e-6, 0, 'muon params')  # measured: bitwise
  moved = {sharding_lib.path_str(path): float(np.max(np.abs(a - b))) for (path, a), b in zip(
      jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree.leaves(params))}
  assert min(moved.values()) > 1e-3, moved
  assert set(optim.decayed_paths(cfg, params)) == {
      f'blocks/{m}/{name}/kernel' for m, names in (('attention', ('query', 'key', 'value', 'out')),
                                                   ('mlp', ('gate', 'up', 'down')))
      for name in names}


def test_muon_orthogonalises_each_layer_and_each_of_gpts_q_k_v_alone():
  """GPT's fused qkv [L, D, 3, N, K] and out [L, N, K, D]: Muon's first update of each layer's
  query, key, value and output projection is optax's 2-D Muon of that matrix alone ([D, N K],
  [N K, D]); the untied head, the embeddings and the biases are AdamW's (undecayed)."""
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'gpt.py')
  cfg = disttrain.from_config_dict(helpers.override(cd, {
      'model.num_layers': 2, 'model.hidden': 32, 'model.num_heads': 2, 'model.vocab_size': 256,
      'model.tied_embeddings': False, 'data.seq_len': 16, 'global_batch_size': 8,
      'data.text.bytes': 20_000, 'data.eval_examples': 16, 'eval_batch_size': 16,
      'mesh.data': 1, 'optimizer': 'muon', 'learning_rate': 1.0, 'lr_schedule': 'constant',
      'warmup_steps': 0, 'weight_decay': 0.1, 'eval_every_steps': 0}))
  run = disttrain.setup(cfg, devices=devices(1))
  params = jax.device_get(run.state.params)
  g = jax.tree.map(lambda p: np.random.default_rng(p.size).normal(size=p.shape).astype(np.float32),
                   params)
  tx = optim.build(dataclasses.replace(cfg, weight_decay=0.0))[0]
  updates, _ = jax.jit(tx.update)(g, tx.init(params), params)
  reference = optax.contrib.scale_by_muon()  # 2-D: one matrix

  def muon_2d(matrix):
    return -np.asarray(reference.update(matrix, reference.init(matrix))[0])

  qkv, out = g['blocks']['attention']['qkv']['kernel'], g['blocks']['attention']['out']['kernel']
  layers, d, _, n, k = qkv.shape
  for layer in range(layers):
    for j in range(3):
      np.testing.assert_allclose(
          updates['blocks']['attention']['qkv']['kernel'][layer, :, j].reshape(d, n * k),
          muon_2d(qkv[layer, :, j].reshape(d, n * k)), rtol=1e-4, atol=1e-6,
          err_msg=f'qkv layer {layer} part {j}')
    np.testing.assert_allclose(
        updates['blocks']['attention']['out']['kernel'][layer].reshape(n * k, d),
        muon_2d(out[layer].reshape(n * k, d)), rtol=1e-4, atol=1e-6, err_msg=f'out {layer}')
  assert set(optim.decayed_paths(cfg, params)) == {
      'blocks/attention/qkv/kernel', 'blocks/attention/out/kernel', 'blocks/mlp/mlp_in/kernel',
      'blocks/mlp/mlp_out/kernel'}
  assert 'unembed' in params and 'positions' in params


@pytest.mark.slow  # 15 s: two set-ups and compilations
def test_muon_on_data_fsdp_tensor_equals_one_device():
  """3 Muon steps on data 2 x fsdp 2 x tensor 2 (the width split over fsdp, heads over tensor)
  follow 1 device: Newton-Schulz on the sharded matrices, float reassociation apart (measured:
  losses to 1e-7, parameters to 8e-7 absolute)."""
  def train(mesh: dict, n: int):
    cfg = _config(optimizer='muon', learning_rate=0.02, adam_learning_rate=LR, weight_decay=0.1,
                  **mesh)
    run = disttrain.setup(cfg, devices=devices(n))
    it = data.TrainIterator(run.train_data, cfg.global_batch_size, cfg.seed, run.batch_sharding)
    state, losses = run.steps.place(run.state), []
    for _ in range(3):
      state, metrics = run.steps.train(state, next(it))
      losses.append(float(metrics['loss']))
    it.close()
    return losses, helpers.to_numpy(run.steps.export(state).params)

  ref_losses, ref_params = train({'mesh.data': 1}, 1)
  losses, params = train({'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2}, 8)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  helpers.assert_trees_close(params, ref_params, 1e-5, 4e-6, 'muon params on 8 devices')


def test_optimizer_fields_refuse_what_would_be_ignored():
  with pytest.raises(ConfigError, match="adam_learning_rate=0.001 is the AdamW part of optimizer="):
    _config(optimizer='adamw', adam_learning_rate=1e-3)
  with pytest.raises(ConfigError, match='weight_decay_embeddings=True'):
    _config(optimizer='muon', weight_decay_embeddings=True)
  for fields, message in ((dict(optimizer='sgd', b1=0.5), "b1=0.5 does nothing with optimizer="),
                          (dict(optimizer='adafactor', b2=0.5), "b2=0.5 does nothing"),
                          (dict(optimizer='sgd', mu_dtype='bfloat16'), "mu_dtype='bfloat16'")):
    with pytest.raises(ConfigError, match=re.escape(message)):  # it was ignored
      _config(**fields)
  _config(optimizer='adafactor', b1=0.9, mu_dtype='bfloat16')  # its momentum: read
  for optimizer in ('adam', 'sgd'):  # optax's adam and sgd take no decay: it was dropped
    with pytest.raises(ConfigError,
                       match=f"weight_decay=0.1 does nothing with optimizer='{optimizer}'"):
      _config(optimizer=optimizer, weight_decay=0.1)


def test_keras_embeddings_and_classifier_heads_are_named_by_their_paths():
  """Keras keeps an Embedding's table in 'embeddings' (it was decayed unless the layer was named
  'embedding'); classifier heads (NNX 'head', Keras 'predictions', transformers' 'lm_head',
  'classifier') were orthogonalised by Muon, which keeps to the hidden layers."""
  for path in ('embedding_1/embeddings', 'tok_emb/embeddings'):
    assert not optim.decays(path, 2, embeddings=False) and optim.decays(path, 2, embeddings=True)
  for path in ('head/kernel', 'predictions/kernel', 'lm_head/kernel', 'classifier/kernel'):
    assert optim.muon_axes(path, 2) is None, path
  assert optim.muon_axes('dense_1/kernel', 2) is not None

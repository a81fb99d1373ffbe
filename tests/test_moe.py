"""Mixture of experts: routing against a numpy reference, expert parallelism equal to 1 device.

Routing is exact (integer queues), the router losses equal numpy's to 1e-6. One step (slow
tier) on data 2 x expert 4, data 2 x expert 2 x tensor 2 and fsdp 2 x expert 4 (Llama) and on
expert=8 (GPT) equals 1 device with the tolerances of tests/test_equivalence.py (rtol 1e-5):
routing and capacity are per row, so no layout changes which token reaches which expert. The one
step is SGD at learning rate 1 (tests/test_llama.py `_one_step`), so its gradient check covers the
sharded update too; the real optimizers' sharded updates are tests/test_equivalence.py's (Adam on
every layout) and the 10-step language-model tests' (adamw).
"""

import collections
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain import data, errors, models
from disttrain.hf import export
from disttrain.models import moe
from disttrain.parallel.step import Variant
from disttrain.training import memory
from tests import helpers
from tests.test_llama import _one_step
from tests.helpers import assert_trees_close, devices

TINY = {'model.num_layers': 2, 'model.hidden': 64, 'model.num_heads': 4, 'model.mlp_dim': 128,
        'data.seq_len': 32, 'global_batch_size': 16, 'data.text.bytes': 100_000,
        'data.eval_examples': 64, 'eval_batch_size': 64, 'eval_every_steps': 0,
        'model.num_experts': 8, 'model.experts_per_token': 2}


def _config(name: str = 'llama', **overrides) -> disttrain.Config:
  from tests.test_context import CONFIGS  # pylint: disable=g-import-not-at-top
  extra = {'model.num_kv_heads': 2} if name == 'llama' else {'model.vocab_size': 256}
  cd = helpers.config_file(CONFIGS[name])
  return disttrain.from_config_dict(helpers.override(cd, {**TINY, **extra, **overrides}))


def _numpy_route(experts, num_experts, slots):
  """Per row: first choices in position order, then second choices, ...; the first `slots` of
  each expert's queue are kept. Returns {(b, t, e): slot} and the dropped (b, t, e)."""
  kept, dropped = {}, []
  b, t, k = experts.shape
  for row in range(b):
    used = collections.Counter()
    for rank in range(k):
      for pos in range(t):
        e = int(experts[row, pos, rank])
        if used[e] < slots:
          kept[(row, pos, e)] = used[e]
        else:
          dropped.append((row, pos, e))
        used[e] += 1
  return kept, dropped


@pytest.mark.parametrize('factor', [0.0, 1.0, 0.5])
def test_every_choice_reaches_its_expert_once_or_is_counted_as_dropped(factor):
  b, t, e, k = 3, 40, 8, 2
  logits = jax.random.normal(jax.random.key(0), (b, t, e)) * 2
  top_logits, experts = jax.lax.top_k(logits, k)
  gates = jax.nn.softmax(top_logits, axis=-1)
  slots = moe.capacity(t, e, k, factor)
  dispatch, combine, kept_rows = moe.route(experts, gates, e, slots)
  dispatch, combine = np.asarray(dispatch), np.asarray(combine)
  kept, dropped = _numpy_route(np.asarray(experts), e, slots)
  want = np.zeros((b, t, e, slots))
  for (row, pos, ex), slot in kept.items():
    want[row, pos, ex, slot] = 1
  np.testing.assert_array_equal(dispatch, want)
  assert dispatch.sum(axis=(1, 3)).max() <= slots  # no expert over capacity
  np.testing.assert_array_equal(kept_rows, [sum(r == row for r, _, _ in kept) for row in range(b)])
  assert int(np.sum(kept_rows)) + len(dropped) == b * t * k
  # The combine weights are the kept choices' gates.
  for (row, pos, ex), slot in kept.items():
    rank = list(np.asarray(experts[row, pos])).index(ex)
    np.testing.assert_allclose(combine[row, pos, ex, slot], gates[row, pos, rank], rtol=1e-6)
  if factor == 0:
    assert not dropped and slots == t  # dropless
  if factor == 0.5:
    assert dropped  # the counterfactual: a small capacity does drop


def test_router_losses_equal_numpy():
  b, t, e, k = 2, 16, 4, 2
  logits = np.asarray(jax.random.normal(jax.random.key(1), (b, t, e)) * 3, np.float64)
  experts = np.argsort(-logits, axis=-1)[..., :k]
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  balance = moe.switch_balance(jnp.asarray(probs, jnp.float32), jnp.asarray(experts))
  z = moe.z_loss(jnp.asarray(logits, jnp.float32))
  fraction = np.array([(experts == i).sum() for i in range(e)]) / (b * t * k)
  np.testing.assert_allclose(balance, e * np.sum(fraction * probs.mean((0, 1))), rtol=1e-6)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(z, np.mean(lse ** 2), rtol=1e-6)
  # With padding (real 0): the same over the real tokens alone.
  real = np.arange(t) < np.array([[11], [5]])
  balance = moe.switch_balance(jnp.asarray(probs, jnp.float32), jnp.asarray(experts),
                               jnp.asarray(real))
  fraction = np.array([(experts[real] == i).sum() for i in range(e)]) / (real.sum() * k)
  np.testing.assert_allclose(balance, e * np.sum(fraction * probs[real].mean(0)), rtol=1e-6)
  np.testing.assert_allclose(moe.z_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(real)),
                             np.mean(lse[real] ** 2), rtol=1e-6)


def test_a_packed_rows_padding_takes_no_expert_slot_and_enters_no_router_loss():
  """Padding (segment id 0) after a packed row's documents: what it holds moves neither the
  documents' logits, nor the router losses, nor the dropped count, with a capacity that drops
  (before: its first choices queued ahead of the documents' second choices and its tokens entered
  both losses' means); dropless, the router losses are those of the documents alone, unpadded."""
  b, n, t = 2, 20, 32  # two rows: a document of 12 and one of 8 tokens, then 12 of padding
  rng = np.random.default_rng(3)
  segments = np.zeros((b, t), np.int32)
  segments[:, :12], segments[:, 12:n] = 1, 2
  positions = np.where(segments > 0, np.r_[np.arange(12), np.arange(8), np.zeros(t - n)], 0)

  def rows(tokens, length=t):
    return {'tokens': jnp.asarray(tokens[:, :length]), 'segment_ids': jnp.asarray(
        segments[:, :length]), 'positions': jnp.asarray(positions[:, :length], jnp.int32)}

  # Slots with the pooled (transformers) statistics; the Switch loss, dropless.
  for balance, factor in (('transformers', 0.5), ('switch', 0.0)):
    cfg = _config(**{'model.router_balance': balance, 'model.expert_capacity': factor})
    model = models.build(cfg.model, context=t)
    apply = jax.jit(lambda params, batch: model.apply(params, batch, train=False, rng=None))
    tokens = rng.integers(0, 256, (b, t))
    params = jax.jit(model.init)(jax.random.key(0), rows(tokens))
    other = np.where(segments > 0, tokens, rng.integers(0, 256, (b, t)))  # other padding
    (out, _, loss), (out2, _, loss2) = [apply(params, rows(x)) for x in (tokens, other)]
    np.testing.assert_allclose(out['logits'][:, :n], out2['logits'][:, :n], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, loss2, rtol=1e-6)
    np.testing.assert_array_equal(out['moe_dropped'], out2['moe_dropped'])
    if factor:
      assert float(out['moe_dropped'].min()) > 0, out['moe_dropped']  # the capacity binds
    else:
      _, _, alone = apply(params, rows(tokens, n))
      np.testing.assert_allclose(loss, alone, rtol=1e-5)


LAYOUTS = {'expert=8': {'mesh.data': 1, 'mesh.expert': 8},
           'data 2 x expert 4': {'mesh.data': 2, 'mesh.expert': 4},
           'data 2 x expert 2 x tensor 2': {'mesh.data': 2, 'mesh.expert': 2, 'mesh.tensor': 2},
           'fsdp 2 x expert 4': {'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.expert': 4}}


def _check_one_step(name: str, layouts):
  ref_loss, ref_grads = _one_step(_config(name, **{'mesh.data': 1}), 1)
  for layout in layouts:
    loss, grads = _one_step(_config(name, **LAYOUTS[layout]), 8)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, 1e-5, 1e-6, f'{name} {layout} gradient and update')


@pytest.mark.slow
def test_one_step_with_experts_split_equals_one_device():
  """Llama with the experts split beside data and tensor; GPT on expert=8. (Experts beside fsdp:
  test_moe_families.py, mixtral and qwen3_moe on fsdp x expert x tensor.)"""
  _check_one_step('llama', ['data 2 x expert 2 x tensor 2'])
  _check_one_step('gpt', ['expert=8'])


@pytest.mark.slow
def test_each_device_holds_an_eighth_of_the_experts_and_tokens_travel_by_all_to_all(tmp_path):
  cfg = _config(**LAYOUTS['expert=8'], num_train_steps=1)
  run = disttrain.setup(cfg, devices=devices(8))
  for name in ('gate', 'up', 'down'):
    leaf = run.state.params['blocks']['moe'][name]
    shard = leaf.sharding.shard_shape(leaf.shape)
    assert np.prod(shard) * 8 == np.prod(leaf.shape), (name, shard, leaf.shape)
  compiled = run.steps.make_train(Variant(full_batch=True)).lower(
      run.state, memory.train_batch_spec(run)).compile().as_text()
  ops = collections.Counter(re.findall(r' (all-to-all|all-gather|all-reduce)\(', compiled))
  assert ops['all-to-all'] >= 4, ops  # dispatch and combine, forward and backward
  disttrain.train(cfg, str(tmp_path), devices=devices(8))
  info = json.loads((tmp_path / 'run.json').read_text())
  assert info['param_specs']['blocks/moe/gate'][1] == 'expert', info['param_specs']
  with pytest.raises(errors.ConfigError, match='mixture-of-experts model'):
    export.export(str(tmp_path), str(tmp_path / 'hf'))  # no Hugging Face layout for it


@pytest.mark.slow
def test_dropped_choices_are_reported_and_none_when_dropless():
  """Train metrics carry moe_dropped (dropped choices in tokens per counted token)."""
  def dropped(capacity: float) -> float:
    cfg = _config(**{'mesh.data': 1, 'model.expert_capacity': capacity})
    run = disttrain.setup(cfg, devices=devices(1))
    it = data.TrainIterator(run.train_data, cfg.global_batch_size, cfg.seed, run.batch_sharding)
    batch = next(it)
    it.close()
    return float(run.steps.train(run.steps.place(run.state), batch)[1]['moe_dropped'])
  assert dropped(0.0) == 0.0  # dropless
  assert dropped(0.25) > 0.1  # a quarter of the even share: most choices find no slot


@pytest.mark.parametrize('overrides,n,message', [
    ({'mesh.data': 1, 'mesh.expert': 3, 'model.num_experts': 8, 'global_batch_size': 24,
      'eval_batch_size': 48}, 3,
     'model.num_experts=8 is not divisible by mesh.expert=3'),
    ({'mesh.data': 1, 'model.experts_per_token': 9}, 1,
     'model.experts_per_token=9 > model.num_experts=8'),
    ({'mesh.data': 4, 'mesh.expert': 2, 'step_mode': 'shard_map'}, 8,
     'mesh.expert=2 splits experts inside the jit step, not step_mode=shard_map'),
    ({'mesh.data': 4, 'mesh.expert': 2, 'model.num_experts': 0}, 8,
     'mesh.expert=2 splits the experts of mixture-of-experts layers, but the model has none'),
])
def test_bad_expert_settings_are_one_line(overrides, n, message):
  with pytest.raises(errors.ConfigError, match=re.escape(message)):
    disttrain.setup(_config(**overrides), devices=devices(n))


@pytest.mark.slow
def test_router_losses_are_reported_apart_from_the_language_model_loss():
  """Eval (and train) records: `loss` is the next-token loss alone, `router_loss` the weighted
  router losses the objective adds (one eval batch here, so both are this call's)."""
  from disttrain.parallel import step as step_lib  # pylint: disable=g-import-not-at-top
  cfg = _config(**{'mesh.data': 1})
  run = disttrain.setup(cfg, devices=devices(1))
  evals = run.eval_data['eval']
  assert len(evals) == cfg.eval_batch
  params = jax.device_get(run.state.params)
  rows = step_lib.with_mask(evals.read(np.arange(len(evals))))
  outputs, _, router = run.model.apply({'params': params}, rows, train=False, rng=None)
  loss = float(np.sum(run.task.per_example(outputs, rows)['loss']) / np.sum(
      run.task.weights(rows)))
  result = disttrain.evaluate(run.steps, run.state, evals, cfg.eval_batch, run.batch_sharding)
  np.testing.assert_allclose(result['loss'], loss, rtol=1e-5)
  np.testing.assert_allclose(result['router_loss'], float(router), rtol=1e-5)
  assert float(router) > 0


def test_a_request_scores_the_same_whatever_its_batch_mates():
  """Evaluation scores route dropless: with the training capacity, padding and a longer
  batch-mate took expert slots and moved a request's log-likelihood (by 1.5e-2 in a review)."""
  from disttrain.evaluation import scoring  # pylint: disable=g-import-not-at-top
  from disttrain.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  cfg = _config(**{'mesh.data': 1, 'model.expert_capacity': 1.25})
  run = disttrain.setup(cfg, devices=devices(1))
  params = jax.tree.map(lambda x: x * 3.0, jax.device_get(run.state.params))  # a peaked router
  rng = np.random.default_rng(3)
  request = lambda n: (list(rng.integers(1, 250, n)), list(rng.integers(1, 250, 10)))
  short, long = request(30), request(110)
  scorer = scoring.Scorer(run.model, mesh_lib.batch_sharding(run.mesh), 2, 128, ())
  alone = scorer.loglikelihoods(params, run.state.mutable, [short])[0][0]
  batched = scorer.loglikelihoods(params, run.state.mutable, [short, long])[0][0]
  assert alone == batched


def test_a_prompt_decodes_the_same_whatever_its_batch_mates():
  """`disttrain generate` routes dropless too: with the training capacity, the prefill's left
  padding and a longer batch-mate took expert slots and changed a prompt's continuation."""
  from disttrain.hf import generate  # pylint: disable=g-import-not-at-top
  cfg = _config(**{'mesh.data': 1, 'model.expert_capacity': 1.25})
  run = disttrain.setup(cfg, devices=devices(1))
  params = jax.tree.map(lambda x: x * 3.0, jax.device_get(run.state.params))  # a peaked router
  rng = np.random.default_rng(3)
  short, long = list(rng.integers(1, 250, 8)), list(rng.integers(1, 250, 60))  # no padding alone
  alone = generate.generate(run.model, params, [short], max_new_tokens=12)
  batched = generate.generate(run.model, params, [short, long], max_new_tokens=12)
  assert alone.tokens[0] == batched.tokens[0]
  np.testing.assert_allclose(alone.logprobs[0], batched.logprobs[0], rtol=1e-5, atol=1e-6)

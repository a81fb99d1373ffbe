"""GRPO (data.name=prompts): the objective against numpy and torch references, the rollout's rows,
a run on data x fsdp x tensor equal to 1 device, a SIGKILLed run resuming bit for bit, and the
example config learning its sums."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain.data.records import MASK
from disttrain.models import chunked_loss, grpo
from disttrain.training import rollout
from tests import helpers
from tests.conftest import ROOT, subprocess_env
from tests.helpers import devices

EXAMPLE = ROOT / 'launch' / 'configs' / 'grpo_sums.py'


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_the_loss_ratios_clipping_and_kl_equal_a_numpy_reference():
  """Fixed logits of policy, sampling policy and reference on rows with prompt tokens (targets
  -1), completions of different lengths (loss mask) and advantages of both signs: the task's
  sums equal the formulas evaluated in numpy (float64), at temperature 0.7."""
  rng = np.random.default_rng(0)
  b, t, v, temp = 6, 7, 11, 0.7
  policy, old, ref = (rng.normal(size=(b, t, v)).astype(np.float32) for _ in range(3))
  old = policy + 0.4 * old  # ratios well away from 1: both clips happen
  targets = rng.integers(0, v, size=(b, t)).astype(np.int32)
  targets[:, :2] = -1  # the prompt
  loss_mask = np.zeros((b, t), np.int8)
  for i, n in enumerate([5, 3, 1, 4, 2, 5]):
    loss_mask[i, 2:2 + n] = 1
  adv = np.array([1.5, -0.7, 0.0, -2.0, 0.9, 0.3], np.float32)
  old_logp = np.take_along_axis(_log_softmax(old.astype(np.float64) / temp),
                                np.maximum(targets, 0)[..., None], -1)[..., 0]
  batch = {'targets': jnp.asarray(targets), 'loss_mask': jnp.asarray(loss_mask),
           'advantages': jnp.asarray(adv), 'old_logprobs': jnp.asarray(old_logp, jnp.float32),
           MASK: jnp.ones((b,), jnp.float32)}
  task = grpo.Grpo(epsilon=0.2, epsilon_high=0.28, beta=0.05, temperature=temp)
  got = task.per_example({'policy': jnp.asarray(policy), 'reference': jnp.asarray(ref)}, batch)

  # numpy, float64: TRL's per-token GRPO loss with k3 KL, summed over each completion
  w = ((targets >= 0) & (loss_mask != 0)).astype(np.float64)
  pick = lambda logits: np.take_along_axis(_log_softmax(logits.astype(np.float64) / temp),
                                           np.maximum(targets, 0)[..., None], -1)[..., 0]
  logp, ref_logp = pick(policy), pick(ref)
  ratio = np.exp(logp - old_logp)
  a = adv[:, None].astype(np.float64)
  per_token = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.28) * a)
  kl = np.exp(ref_logp - logp) - (ref_logp - logp) - 1
  clipped = ((ratio < 0.8) & (a < 0)) | ((ratio > 1.28) & (a > 0))
  assert 0 < (clipped * w).sum() < w.sum()  # some tokens clipped, not all
  np.testing.assert_allclose(got['loss'], ((per_token + 0.05 * kl) * w).sum(-1), rtol=2e-5,
                             atol=1e-6)
  np.testing.assert_allclose(got['kl'], (kl * w).sum(-1), rtol=2e-5, atol=1e-7)
  np.testing.assert_array_equal(got['clip_fraction'], (clipped * w).sum(-1))
  np.testing.assert_array_equal(task.weights(batch), w.sum(-1))

  # One update per batch: old = stop_gradient(policy), so the gradient is -A grad log p.
  one = grpo.Grpo(temperature=temp)
  no_old = {k: x for k, x in batch.items() if k != 'old_logprobs'}
  grad = jax.grad(lambda x: one.per_example(x, no_old)['loss'].sum())(jnp.asarray(policy))
  grad_logp = jax.grad(lambda x: (grpo.token_logprobs(x, no_old, temp)[0]
                                  * jnp.asarray(a, jnp.float32)).sum())(jnp.asarray(policy))
  np.testing.assert_allclose(grad, -grad_logp, rtol=1e-6, atol=1e-7)

  # The chunked loss's per-token values equal the whole logits' (a padded last chunk).
  hidden = jnp.asarray(rng.normal(size=(b, t, 5)), jnp.float32)
  unembed = jnp.asarray(rng.normal(size=(5, v)), jnp.float32)
  features = chunked_loss.Features(hidden, unembed, v, False, 3, jnp.float32)
  np.testing.assert_allclose(
      chunked_loss.token_losses(features, batch['targets'], jnp.asarray(w, jnp.float32), temp),
      chunked_loss.token_losses(features.logits(), batch['targets'], jnp.asarray(w, jnp.float32),
                                temp), rtol=1e-6, atol=1e-6)
  # So do the loss's sums and their gradients, made chunk by chunk ahead of the backward pass,
  # for rows weighed alike (the unembedding's gradient made ahead too) and not (it is remade).
  reference = chunked_loss.Features(hidden + 0.3, unembed, v, False, 3, jnp.float32)

  def objective(h, u, row_weights, chunked):
    policy = chunked_loss.Features(h, u, v, False, 3, jnp.float32)
    outputs = ({'policy': policy, 'reference': reference} if chunked else
               {'policy': policy.logits(), 'reference': reference.logits()})
    out = task.per_example(outputs, batch)
    return (out['loss'] * row_weights).sum(), out

  for row_weights in (np.ones(b, np.float32), np.array([1, 2, 0, 1, 3, 1], np.float32)):
    (_, got), got_g = jax.value_and_grad(objective, (0, 1), has_aux=True)(
        hidden, unembed, row_weights, True)
    (_, want), want_g = jax.value_and_grad(objective, (0, 1), has_aux=True)(
        hidden, unembed, row_weights, False)
    helpers.assert_trees_close(got, want, 1e-5, 1e-6, 'chunked GRPO values')
    helpers.assert_trees_close(got_g, want_g, 1e-5, 1e-6, f'chunked GRPO gradients {row_weights}')


def test_rows_train_the_completion_and_its_eos_after_a_left_padded_prompt():
  import types  # pylint: disable=g-import-not-at-top
  eos = 9
  prompt, mask = np.array([[0, 0, 5, 6], [1, 2, 3, 4]]), np.array([[0, 0, 1, 1], [1, 1, 1, 1]])
  completions = np.array([[7, eos, eos], [8, 8, 8]])  # an ended one, one cut at the length
  rows = rollout.Rollout._rows(types.SimpleNamespace(prompt_len=4, new=3), prompt, mask,  # pylint: disable=protected-access
                               completions, np.array([2, 3]), np.array([0.5, -0.5], np.float32))
  np.testing.assert_array_equal(rows['tokens'], [[0, 0, 5, 6, 7, eos, eos], [1, 2, 3, 4, 8, 8, 8]])
  np.testing.assert_array_equal(rows['targets'], [[-1, -1, -1, 7, eos, -1, -1],
                                                  [-1, -1, -1, 8, 8, 8, -1]])
  np.testing.assert_array_equal(rows['loss_mask'], [[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0]])
  np.testing.assert_array_equal(rows['segment_ids'], [[0, 0, 1, 1, 1, 1, 1], [1] * 7])
  np.testing.assert_array_equal(rows['positions'], [[0, 0, 0, 1, 2, 3, 4], list(range(7))])
  np.testing.assert_array_equal(rows['advantages'], [0.5, -0.5])


def test_rewards_load_by_path_in_order_and_each_value_is_checked():
  from tests.configs import rewards  # pylint: disable=g-import-not-at-top
  named = rollout.load_rewards('tests.configs.rewards.length,tests.configs.rewards.words')
  assert [name for name, _ in named] == ['tests.configs.rewards.length',
                                         'tests.configs.rewards.words']
  with pytest.raises(disttrain.errors.DataError,
                     match=r"^reward tests.configs.rewards.words returned 'high' \(str\) among its "
                           'values; return a number per completion$'):
    rollout.score(named, ['1+1='] * 3, ['02', '2', ''], [[48, 50], [50], []], {})
  with pytest.raises(disttrain.errors.DataError,
                     match=r'^reward too_few returned 15 values for 16 completions; return one '
                           'number per completion$'):
    rollout.score([('too_few', rewards.too_few)], ['1+1='] * 16, ['2'] * 16, [[50]] * 16, {})
  values = rollout.score([('length', rewards.length)], ['a'] * 2, ['xy', ''], [[1, 2], []], {})
  np.testing.assert_array_equal(values['length'], [2.0, 0.0])
  # Functions of one name each count (the second replaced the first in the sum); one function
  # alone, as TRL's reward_funcs takes it; a prompt field named like an argument is left out as
  # TRL does (both were tracebacks).
  twice = rollout.load_rewards('', [lambda completions, **_: [1.0] * len(completions),
                                    lambda completions, **_: [10.0] * len(completions)])
  assert [name for name, _ in twice] == ['<lambda>_1', '<lambda>_2']
  values = rollout.score(twice, ['a'], ['x'], [[1]], {'completions': ['field'], 'n': [3]})
  assert np.sum(list(values.values()), axis=0).tolist() == [11.0]
  assert [name for name, _ in rollout.load_rewards('', rewards.length)] == ['length']


# One launch (a compiled step): rollout.score raises both messages (the count and the type) on the
# same path, checked in test_rewards_load_by_path_in_order...; a second launch repeated it (7 s).
@pytest.mark.slow
@pytest.mark.parametrize('name, line', [
    ('too_few', 'returned 15 values for 16 completions; return one number per completion')])
def test_a_bad_reward_stops_the_launch_in_one_line(tmp_path, name, line):
  """Found at the first step, after compilation: one line naming the function and what it
  returned, exit status 2, no train record."""
  env = subprocess_env()
  proc = subprocess.run(
      [sys.executable, 'launch/train.py', f'--config={EXAMPLE}', f'--workdir={tmp_path}',
       f'--config.grpo.rewards=tests.configs.rewards.{name}', '--config.global_batch_size=16'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0] == f'error: DataError: reward tests.configs.rewards.{name} {line}', lines
  assert not helpers.metrics_records(tmp_path)


def test_advantages_equal_torch_group_normalisation():
  torch = pytest.importorskip('torch')
  rewards = np.array([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 2, -1, 3, 0.25], np.float64)
  got = rollout.advantages(rewards, 4)
  grouped = torch.tensor(rewards).view(-1, 4)  # TRL: (r - mean) / (std + 1e-4), torch's std
  want = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4))
  np.testing.assert_allclose(got, want.reshape(-1).numpy(), rtol=1e-6)
  assert np.all(got[4:8] == 0)  # a group that agrees teaches nothing


# Two updates per sampled batch (old log-probabilities, clipping), a KL penalty (the reference),
# records every dispatch, a checkpoint every 4 steps.
RUN = {'grpo.iterations': 2, 'steps_per_dispatch': 2, 'grpo.beta': 0.04, 'num_train_steps': 12,
       'log_every_steps': 2, 'checkpoint_every_steps': 4, 'learning_rate': 3e-3}
LAYOUT = {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2, 'sharding': 'fsdp',
          'fsdp_min_size': 256}


# Wall-clock fields: measured, not computed, so they differ between any two runs.
TIMED = {'examples_per_sec', 'tokens_per_sec', 'data_wait_fraction', 'sample_seconds',
         'sample_tokens_per_sec', 'learn_seconds', 'learn_tokens_per_sec', 'sample_fraction'}


def _example(**overrides):
  module = __import__('runpy').run_path(str(EXAMPLE))
  cd = helpers.override(module['get_config'](), overrides)
  return disttrain.config.from_config_dict(cd), module['get_rewards'](None)


def _records(workdir) -> dict:
  return {r['step']: r for r in helpers.metrics_records(workdir)}


@pytest.mark.slow  # three GRPO runs (8.3 s of the quick tier)
def test_a_resume_with_other_iterations_is_refused_keeping_the_checkpoint(tmp_path):
  """GRPO's data position counts sampled batches: a checkpoint at step 3 resumed with
  grpo.iterations=2 never met num_train_steps and ended at 7 'done', with no final save."""
  from disttrain.errors import ConfigError  # pylint: disable=g-import-not-at-top
  common = {'global_batch_size': 16, 'log_every_steps': 2, 'checkpoint_every_steps': 0}
  cfg, rewards = _example(num_train_steps=3, **common)
  disttrain.train(cfg, str(tmp_path), devices=devices(1), rewards=rewards)
  cfg, rewards = _example(num_train_steps=8, steps_per_dispatch=2, **{'grpo.iterations': 2},
                          **common)
  with pytest.raises(ConfigError, match='checkpoint is at step 3, not a multiple of '
                                        r'steps_per_dispatch=2 \(grpo.iterations\)'):
    disttrain.train(cfg, str(tmp_path), devices=devices(1), rewards=rewards)
  assert os.listdir(tmp_path / 'checkpoints') == ['3']


def test_prompts_beyond_the_vocabulary_or_too_few_for_a_step_are_one_line(tmp_path):
  """Ids beyond model.vocab_size trained silently; 3 prompts for a step of 8 were 'fewer than
  global_batch_size=8; pass N <= 3' (completions counted as prompts, 3 then refused)."""
  from disttrain.errors import DataError  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as setup_lib  # pylint: disable=g-import-not-at-top
  cfg, rewards = _example(**{'model.vocab_size': 50})
  with pytest.raises(DataError, match="data.tokenizer='bytes' has 257 tokens but "
                                      'model.vocab_size=50'):
    setup_lib.setup(cfg, devices=devices(1), rewards=rewards)
  three = tmp_path / 'three.jsonl'
  three.write_text(''.join(open(cfg.data.train_files, encoding='utf-8').readlines()[:3]))
  cfg, rewards = _example(**{'data.train_files': str(three)})
  with pytest.raises(DataError, match=r'has 3 prompts, fewer than the 8 a step samples '
                                      r'\(global_batch_size=64 completions / grpo.group_size=8\); '
                                      'use more prompts or global_batch_size <= 24'):
    setup_lib.setup(cfg, devices=devices(1), rewards=rewards)


def test_a_mixture_of_experts_rollout_samples_a_prompt_whatever_its_padding():
  """With expert_capacity the rollout's prefill queued a prompt's left padding for expert slots
  (up to 7 of 8 tokens' choices dropped): its log-probabilities moved with data.seq_len by 8e-3.
  It routes without a capacity, as generate and the scorer do."""
  from disttrain.models import decoding  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as setup_lib  # pylint: disable=g-import-not-at-top
  cfg, rewards = _example(**{'model.num_experts': 4, 'model.experts_per_token': 2,
                             'model.expert_capacity': 1.25})
  run = setup_lib.setup(cfg, devices=devices(1), rewards=rewards)
  decisive = jax.tree_util.tree_map_with_path(  # routing by wide margins: the drops show
      lambda p, x: x * 20 if 'router' in jax.tree_util.keystr(p) else x, run.state.params)
  loop = jax.jit(decoding.decode_loop(run.rollout.module, 4, (), 0.0, 0, 1.0))
  logps = [np.asarray(loop(decisive, *map(jnp.asarray, decoding.left_padded(
      [[5, 17, 3, 44, 42, 9, 11, 23]], length)), jax.random.key(0))[1]) for length in (8, 32)]
  np.testing.assert_allclose(logps[1], logps[0], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_the_trained_log_probabilities_of_sampled_rows_are_the_samplers(tmp_path):
  """On data x fsdp x tensor: the decoder samples completions of left-padded prompts with its
  KV cache; the rows the rollout makes of them, run through the training forward pass, give
  each completion token the log-probability the sampler drew it with (1e-5): prompt, positions,
  segments and targets line up."""
  del tmp_path
  from disttrain.models import decoding  # pylint: disable=g-import-not-at-top
  from disttrain.training import setup as setup_lib  # pylint: disable=g-import-not-at-top
  cfg, rewards = _example(**LAYOUT)
  run = setup_lib.setup(cfg, devices=devices(8), rewards=rewards)
  r, state = run.rollout, run.state
  prompt = np.repeat(r.prompt_set.arrays['prompt'][:8], 8, axis=0)
  mask = np.repeat(r.prompt_set.arrays['prompt_mask'][:8], 8, axis=0).astype(np.int32)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  put = lambda x: jax.device_put(x, run.batch_sharding)
  loop = decoding.decode_loop(run.model.module, r.new, r.stops, 1.0, 0, 1.0)
  tokens, sampled = jax.jit(loop)(state.params, put(prompt), put(mask), put(positions),
                                  jax.random.key(3))
  tokens, sampled = np.asarray(tokens), np.asarray(sampled)
  ends = np.isin(tokens, r.stops)  # after its EOS a row holds EOS, not what was drawn: not trained
  lengths = np.where(ends.any(axis=1), ends.argmax(axis=1) + 1, r.new)
  rows = r._rows(prompt, mask, tokens, lengths, np.zeros(len(tokens), np.float32))  # pylint: disable=protected-access
  batch = {k: put(v) for k, v in rows.items()}
  outputs, _, _ = jax.jit(lambda p, b: run.model.apply({'params': p}, b, train=False, rng=None))(
      state.params, batch)
  logp, weights = grpo.token_logprobs(outputs, batch, 1.0)
  p, counted = r.prompt_len, np.arange(r.new)[None, :] < lengths[:, None]
  assert counted.sum() > 100
  np.testing.assert_array_equal(np.asarray(weights)[:, p - 1:p - 1 + r.new], counted)
  np.testing.assert_allclose(np.asarray(logp)[:, p - 1:p - 1 + r.new] * counted,
                             sampled * counted, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_grpo_on_data_fsdp_tensor_equals_one_device_and_resumes_bitwise_after_sigkill(tmp_path):
  """The example's GRPO on 8 devices: its first steps' rewards equal 1 device's exactly (the same
  completions sampled) and its losses within float32 reassociation; a launch SIGKILLed after the
  step-4 checkpoint and relaunched gives the uninterrupted run's records (rewards, losses, KL,
  clip fractions) and final parameters bit for bit: sampling restarts from fold_in(seed, step)."""
  cfg8, rewards = _example(**{**RUN, **{k: v for k, v in LAYOUT.items()}})
  straight = disttrain.train(cfg8, str(tmp_path / 'straight'), devices=devices(8),
                             rewards=rewards)
  assert straight.trace_count == 1
  want = _records(tmp_path / 'straight')
  assert sorted(want) == list(range(2, 13, 2))
  assert any(r['clip_fraction'] > 0 for r in want.values())  # the second update clips some
  assert all(r['kl'] >= 0 for r in want.values())

  cfg1, _ = _example(**{**RUN, 'num_train_steps': 4})
  disttrain.train(cfg1, str(tmp_path / 'one'), devices=devices(1), rewards=rewards)
  for step, got in _records(tmp_path / 'one').items():
    assert got['reward'] == want[step]['reward'], step
    assert got['completion_length'] == want[step]['completion_length'], step
    # Steps 1-4 sample no reward here (every advantage 0): the only gradient is the KL's, exactly
    # 0 at the reference on 1 device and float32 reassociation noise on 8, which Adam scales to
    # steps of up to the learning rate: KL 1.3e-6 against 0 (jax 0.12.0.1), the loss beta times it.
    for name, atol in (('loss', 1e-6), ('kl', 1e-5)):
      np.testing.assert_allclose(got[name], want[step][name], rtol=1e-4, atol=atol)

  killed = tmp_path / 'killed'
  flags = [f'--config={EXAMPLE}', f'--workdir={killed}', '--fake_devices=8',
           *[f'--config.{k}={v}' for k, v in {**RUN, **LAYOUT}.items()]]
  env = subprocess_env()
  helpers.sigkill_after_checkpoint([sys.executable, 'launch/train.py', *flags], killed, 4, env,
                                  ROOT)
  out = subprocess.run([sys.executable, 'launch/train.py', *flags], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  resumed = int(out.stdout.split('resumed from step ')[1].split(':')[0])
  assert 4 <= resumed < 12
  got = _records(killed)
  for step in range(resumed + 2, 13, 2):
    assert {k: v for k, v in got[step].items() if k not in TIMED} == \
        {k: v for k, v in want[step].items() if k not in TIMED}, step
  for a, b in zip(helpers.saved_params(killed, 12), helpers.saved_params(tmp_path / 'straight', 12),
                  strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_example_learns_its_sums(tmp_path):
  """launch/configs/grpo_sums.py from scratch on 1 device, as docs/post-training.md reports:
  the reward starts near 0 (random bytes are rarely digits) and passes 0.5 within 100 steps
  (measured 2026-11-27: 0.00 at step 10, 0.46 at 40, 0.58 at 60, 0.66 at 100). A record of 10
  steps gives their sampled batches' mean reward (it was weighted by the steps' completion
  tokens) and the largest completion length (a weighted mean, no length, before)."""
  cfg, rewards = _example(num_train_steps=100, checkpoint_every_steps=0)
  per_step = []  # each step's mean total reward, as the reward functions returned it

  def spied(fn, first):
    @functools.wraps(fn)
    def spy(**kwargs):
      values = fn(**kwargs)
      if first:
        per_step.append(0.0)
      per_step[-1] += float(np.mean(values))
      return values
    return spy
  rewards = [spied(fn, i == 0) for i, fn in enumerate(rewards)]
  result = disttrain.train(cfg, str(tmp_path), devices=devices(1), rewards=rewards)
  train = [r for r in result.records if r['split'] == 'train']
  assert len(per_step) == 100 and [r['step'] for r in train] == list(range(10, 101, 10))
  for r in train:
    np.testing.assert_allclose(r['reward'], np.mean(per_step[r['step'] - 10:r['step']]),
                               rtol=1e-12, err_msg=str(r['step']))
    assert float(r['completion_length_max']).is_integer(), r
  assert train[0]['reward'] < 0.05, train[0]
  assert np.mean([r['reward'] for r in train[-3:]]) > 0.5, [r['reward'] for r in train]
  assert train[-1]['completion_length'] == 2.0  # two digits, never an early EOS

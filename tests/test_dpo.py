"""DPO (disttrain/models/preference.py, disttrain/data/preference.py) against transformers.

One SGD step at learning rate 1 from a Hugging Face Llama (policy = reference): the loss is ln 2,
and the loss and every gradient equal what torch computes from `transformers`' log-probabilities
and the DPO formula written here, on data 2 x fsdp 2 x tensor 2 with grad_accum_steps=2 (rtol
1e-5; the gradient is read back as p0 - p1, see tests/test_llama.py's _one_step). With LoRA the
reference is the base without adapters: one copy of the weights (run.json's state parts).
"""

import json
import math
import re

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import disttrain
from disttrain import models
from disttrain.data import preference, tokenizer as tokenizer_lib
from disttrain.hf import weights as hf
from disttrain.training import setup as run_lib
from tests import helpers
from tests.helpers import devices
from tests.test_llama import CUBE, _config
from tests.test_lora import hf_llama

BETA = 0.1
PAIRS = 8


def _pairs(tmp_path) -> str:
  rng = np.random.default_rng(0)
  words = ['alpha', 'beta', 'gamma', 'delta', 'sum', 'of', 'two', 'is', 'four', 'five']
  path = tmp_path / 'pairs.jsonl'
  with open(path, 'w') as f:
    for _ in range(PAIRS):
      say = lambda n: ' '.join(rng.choice(words, n))
      f.write(json.dumps({'prompt': say(3) + ': ', 'chosen': say(int(rng.integers(1, 5))),
                          'rejected': say(int(rng.integers(1, 5)))}) + '\n')
  return str(path)


def _dpo_config(base: str, pairs: str, **overrides):
  fields = {'restore_from': base, 'model.vocab_size': 260, 'model.mlp_dim': 128,
            'model.tied_embeddings': False, 'data.name': 'preference', 'data.train_files': pairs,
            'data.seq_len': 32, 'data.eval_examples': -1, 'global_batch_size': PAIRS,
            'num_train_steps': 1, 'log_every_steps': 1, 'dpo.beta': BETA, **overrides}
  return _config(**fields)


def _torch_reference(base: str, pairs: str):
  """(loss, {HF tensor name: gradient}) of the DPO loss over every pair, by torch."""
  rows = preference.read([pairs], tokenizer_lib.load(''), 32)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      base, dtype=torch.float32, attn_implementation='eager')
  tokens = torch.tensor(rows['tokens'].reshape(-1, 32), dtype=torch.long)
  targets = torch.tensor(rows['targets'].reshape(-1, 32), dtype=torch.long)
  weights = torch.tensor(((rows['targets'] >= 0) & (rows['loss_mask'] != 0)).reshape(-1, 32),
                         dtype=torch.float32)

  def logps(logits):
    token = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (token * weights).sum(-1).reshape(-1, 2)
  with torch.no_grad():
    reference = logps(model(tokens).logits)
  policy = logps(model(tokens).logits)
  margin = BETA * ((policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1]))
  loss = -torch.nn.functional.logsigmoid(margin).mean()
  loss.backward()
  return float(loss), {name: p.grad.numpy() for name, p in model.named_parameters()}


@pytest.mark.slow
def test_dpo_first_step_is_ln2_and_equals_transformers_on_eight_devices_with_accumulation(
    tmp_path):
  base, pairs = hf_llama(tmp_path, 260), _pairs(tmp_path)
  cfg = helpers.sgd_config(_dpo_config(base, pairs, **CUBE), 1.0, grad_accum_steps=2)
  result = disttrain.train(cfg, str(tmp_path / 'run'), devices=devices(8))
  (record,) = [r for r in result.records if r['split'] == 'train']
  want_loss, want_grads = _torch_reference(base, pairs)
  assert record['loss'] == pytest.approx(math.log(2), rel=1e-6)
  assert record['loss'] == pytest.approx(want_loss, rel=1e-5)
  assert record['reward_margin'] == pytest.approx(0.0, abs=1e-6)
  decoder = models.build(cfg.model, 'float32', 32).cfg
  p0 = safetensors.numpy.load_file(f'{base}/model.safetensors')
  p1 = {name: produce() for name, _, _, produce in
        hf.export_tensors('llama', decoder, helpers.to_numpy(result.state.params), np.float32)}
  ours = {name: p0[name] - p1[name] for name in p1}  # SGD at 1: the gradient
  assert ours.keys() == want_grads.keys()
  for name, want in want_grads.items():
    np.testing.assert_allclose(ours[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_with_lora_the_reference_is_the_base_without_a_second_copy(tmp_path):
  base, pairs = hf_llama(tmp_path, 260), _pairs(tmp_path)
  parts = {}
  for name, extra in (('full', {}), ('lora', {'lora.rank': 4})):
    run = disttrain.setup(_dpo_config(base, pairs, **{'mesh.data': 1}, **extra),
                          devices=devices(1))
    parts[name] = run_lib.run_info(run)['state_bytes_per_device_by_part']
  # Full DPO keeps the reference once beside the policy; LoRA's reference is its frozen base.
  assert parts['full']['frozen'] == parts['full']['params']
  assert parts['lora']['frozen'] == parts['full']['params']
  assert parts['lora']['params'] < parts['full']['params'] / 10


def test_without_a_template_only_the_answers_turns_are_trained():
  """A conversational pair without a chat template: the chosen turn is trained, the prompt's own
  assistant turn is context even where its text equals the chosen one (a repeated answer)."""
  said = {'role': 'assistant', 'content': 'Yes.'}
  record = {'prompt': [{'role': 'user', 'content': 'Sure?'}, said,
                       {'role': 'user', 'content': 'Really?'}],
            'chosen': [dict(said)], 'rejected': [{'role': 'assistant', 'content': 'No.'}]}
  chosen, rejected = preference.pieces(record, 'x', None)
  assert [text for text, trained in chosen if trained] == ['Yes.\n']
  assert [text for text, trained in rejected if trained] == ['No.\n']
  assert ''.join(text for text, _ in chosen).count('Yes.') == 2


def test_a_long_pair_keeps_one_prompt_for_both_answers(tmp_path):
  """Rows of 16: a short chosen kept 14 prompt tokens, a long rejected 8; both now keep the
  same 8 (the prompt's end), so the two answers are scored on one context, as TRL truncates the
  prompt once per pair."""
  path = tmp_path / 'pairs.jsonl'
  path.write_text(json.dumps({'prompt': 'p' * 29 + 'q', 'chosen': 'aa', 'rejected': 'b' * 20}))
  rows = preference.read([str(path)], tokenizer_lib.load(''), seq_len=16)
  tokens, mask = rows['tokens'][0], rows['loss_mask'][0]
  prompts = [bytes(row[:int(np.argmax(m > 0)) + 1].tolist()) for row, m in zip(tokens, mask)]
  assert prompts == [b'ppppppp' + b'q'] * 2, prompts
  assert bytes(tokens[0, 8:10].tolist()) == b'aa' and bytes(tokens[1, 8:16].tolist()) == b'b' * 8


def test_pairs_tokenized_beyond_the_models_vocabulary_are_refused(tmp_path):
  """The sft source's one line: DPO trained ids the embedding does not have (a NaN loss at
  step 1 whose message said to lower the learning rate)."""
  from disttrain.data import sources  # pylint: disable=g-import-not-at-top
  cfg = _dpo_config('', _pairs(tmp_path), **{'model.vocab_size': 200})
  with pytest.raises(disttrain.errors.DataError, match="data.tokenizer='bytes' has 257 tokens but "
                                                       'model.vocab_size=200'):
    sources.build(cfg)


@pytest.mark.parametrize('name,field', [('preference', 'model.dropout'),
                                        ('prompts', 'lora.dropout')])
def test_dropout_on_the_policy_is_refused(tmp_path, name, field):
  """The reference (DPO) and the sampler (GRPO) score without dropout: a policy with it would
  not start at ratio 1 (TRL disables dropout for the same reason)."""
  from tests.conftest import ROOT  # pylint: disable=g-import-not-at-top
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  helpers.override(cd, {'data.name': name, 'data.train_files': str(tmp_path / 'x.jsonl'),
                        'lora.rank': 4, field: 0.1})
  with pytest.raises(disttrain.ConfigError, match=re.escape(
      f'{field}=0.1 with data.name={name}: ') + f'.*set --config.{field}=0'):
    disttrain.from_config_dict(cd)

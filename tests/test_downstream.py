"""Downstream evaluations in the loop (data.eval_tasks, disttrain/evaluation/).

The in-loop records of a tiny Llama trained on 8 devices (data x fsdp x tensor) equal
lm-evaluation-harness's metrics computed here from `transformers` on the run's own export:
log-likelihoods of each choice for accuracy / accuracy_norm, greedy `generate` for exact_match.
Bad task input is one line, and exit status 2 through the launcher.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from lm_eval.filters import extraction as lm_eval_extraction

import disttrain
from disttrain.data import tokenizer as tokenizer_lib
from disttrain.errors import ConfigError, DataError
from disttrain.evaluation import downstream, metrics, scoring, tasks
from disttrain.hf import export
from disttrain.training import setup as setup_lib
from tests import helpers
from tests.conftest import ROOT, subprocess_env

MAX_NEW = 12


def _write(path, rows) -> str:
  path.write_text(''.join(json.dumps(row) + '\n' for row in rows))
  return str(path)


def _questions() -> list[dict]:
  """16 questions whose choices differ in length (so acc and acc_norm can differ); some contexts
  end in a space, which lm-eval's split moves into the continuation; 4 are over 64 tokens."""
  rng = np.random.default_rng(0)
  words = ['cat', 'dog', 'a red house', 'x', 'seventeen', 'def f():', 'the end', '42', 'blue sky',
           'import os', 'zz', 'return None']
  out = []
  for i in range(16):
    choices = [str(c) for c in rng.choice(words, size=3 + i % 2, replace=False)]
    long = 'of the words below, which one comes next in the text we read before? ' * (i % 4 == 0)
    out.append({'context': f'Question {i}: {long}which one?' + (' ' if i % 3 else '\nAnswer:'),
                'choices': choices, 'answer': int(rng.integers(len(choices)))})
  return out


PROMPTS = ['3 + 4 =', 'def f(x):', 'the cat sat', 'import os', '[1, 2, 3', 'Hello world!',
           'x = y * 7', 'while True']  # different last bytes: different continuations


def _config(eval_tasks: str):
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  helpers.override(cd, {
      'model.num_layers': 2, 'model.hidden': 64, 'model.num_heads': 4, 'model.num_kv_heads': 2,
      'model.mlp_dim': 128, 'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2,
      'sharding': 'fsdp', 'fsdp_min_size': 256, 'data.seq_len': 128, 'global_batch_size': 8,
      'eval_batch_size': 8, 'data.text.bytes': 20_000, 'data.eval_examples': 8,
      'num_train_steps': 2, 'warmup_steps': 0, 'learning_rate': 1e-4, 'log_every_steps': 1, 'eval_every_steps': 0,
      'data.eval_tasks': eval_tasks, 'data.eval_max_new_tokens': MAX_NEW})
  return disttrain.from_config_dict(cd)


def _lm_eval_pair(tok, context: str, choice: str) -> tuple[list[int], list[int]]:
  """lm-eval HFLM._encode_pair: trailing whitespace to the continuation, whole split at the
  context's token count."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, choice = context[:-spaces], context[-spaces:] + choice
  whole, ctx = tok.encode(context + choice), tok.encode(context)
  return ctx, whole[len(ctx):]


def _reference_choices(model, tok, questions) -> tuple[int, int]:
  """lm-eval's acc and acc_norm counts from transformers' log-probabilities."""
  correct = correct_norm = 0
  for q in questions:
    lls = []
    for choice in q['choices']:
      ctx, cont = _lm_eval_pair(tok, q['context'], choice)
      ids = ctx + cont
      with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].double(), -1)
      lls.append(float(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont))))
    lls = np.asarray(lls)
    correct += int(np.argmax(lls)) == q['answer']
    lengths = np.asarray([float(len(c)) for c in q['choices']])
    correct_norm += int(np.argmax(lls / lengths)) == q['answer']
  return correct, correct_norm


def _reference_generations(model, tok) -> list[str]:
  out = []
  for prompt in PROMPTS:
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
      new = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    out.append(tok.decode(new[0, ids.shape[1]:].tolist()))
  return out


def _records(result, split: str) -> list[dict]:
  return [r for r in result.records if r['split'] == split]


@pytest.mark.slow  # two 8-device runs and transformers' reference (~25 s)
def test_in_loop_metrics_equal_lm_eval_on_transformers(tmp_path):
  """Run 1 trains 2 steps with both tasks and evaluates them at its end; its export gives the
  transformers reference. The generation file's answers are then rewritten from transformers'
  own greedy texts (5 of 8; 3 can never match), and run 2 resumes the finished run, so its
  loop evaluates the same checkpoint: exact_match is 5/8 only if our greedy decoding reproduces
  transformers' texts."""
  questions = _questions()
  mc = _write(tmp_path / 'mc.jsonl', questions)
  gen = _write(tmp_path / 'gen.jsonl', [{'prompt': p, 'answer': '4'} for p in PROMPTS])
  run = tmp_path / 'run'
  before = dict(scoring.TRACES)
  first = disttrain.train(_config(f'mc={mc};gen={gen}'), str(run))
  # 56 requests in 7 batches of 8 rows: the longest ones padded to 128 tokens, the rest to 64;
  # one compile per bucket, one for decoding
  assert scoring.TRACES['score'] - before.get('score', 0) == 2
  assert scoring.TRACES['greedy'] - before.get('greedy', 0) == 1
  (choice_record,) = _records(first, 'mc')
  assert choice_record['step'] == 2 and choice_record['num_examples'] == 16

  hf_dir = tmp_path / 'hf'
  export.export(str(run), str(hf_dir))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(hf_dir), dtype=torch.float32, attn_implementation='eager').eval()
  tok = tokenizer_lib.load('')
  correct, correct_norm = _reference_choices(model, tok, questions)
  assert round(choice_record['accuracy'] * 16) == correct
  assert round(choice_record['accuracy_norm'] * 16) == correct_norm
  texts = _reference_generations(model, tok)
  # A small learning rate keeps the model near its random start, whose continuations depend on
  # the prompt: a decoding bug then changes them (one constant text would hide it).
  assert len(set(texts)) >= 6, texts
  (gen_record,) = _records(first, 'gen')
  hits = sum(metrics.gsm8k_answer(t) == '4' for t in texts)
  assert gen_record == {'step': 2, 'split': 'gen', 'exact_match': hits / 8, 'num_examples': 8}

  # The sixth line stops at a character of its text (lm-eval's `until`): its answer is the text
  # before that (inside the text where one character cuts it so, else empty), which the whole
  # text does not match.
  cuts = {stop: texts[5].split(stop)[0] for stop in texts[5]}
  stop = next((stop for stop, cut in cuts.items() if cut.strip()
               and metrics.gsm8k_answer(cut) != metrics.gsm8k_answer(texts[5])), texts[5][0])
  assert metrics.gsm8k_answer(cuts[stop]) != metrics.gsm8k_answer(texts[5]), texts[5]
  answers = texts[:5] + [cuts[stop]] + ['never'] * 2
  _write(tmp_path / 'gen.jsonl', [{'prompt': p, 'answer': a, **({'until': [stop]} if i == 5
                                                                 else {})}
                                  for i, (p, a) in enumerate(zip(PROMPTS, answers))])
  second = disttrain.train(_config(f'mc={mc};gen={gen}'), str(run))
  (again,) = _records(second, 'gen')
  assert again['exact_match'] == 6 / 8, (texts, stop, again)
  assert _records(second, 'mc')[0]['accuracy'] == choice_record['accuracy']


def test_lm_eval_metric_definitions():
  """acc takes the summed log-likelihood, acc_norm divides it by the choice's characters."""
  q = tasks.Question('ctx', ('ab', 'abcdef'), 1)
  assert metrics.choice_scores([-4.0, -6.0], q) == (False, True)  # -4 > -6; -2 < -1
  assert metrics.choice_scores([-3.0, -3.0], tasks.Question('c', ('a', 'b'), 0)) == (True, True)
  # A choice's leading space is lm-eval's target delimiter, not counted: -4 / 1 < -6.5 / 2 (it
  # divided by 2 and 3, and picked ' 7').
  q = tasks.Question('3 + 9 =', (' 7', ' 12'), 1)
  assert metrics.choice_scores([-4.0, -6.5], q) == (False, True)
  assert metrics.multiple_choice([[-4.0, -6.0], [-1.0, -9.0]], [q, q]) == {
      'accuracy': 0.0, 'accuracy_norm': 0.5, 'num_examples': 2}
  cases = {'so 3 + 4 = 7.': '7', 'steps 1, 2 #### 1,234': '1234', 'none here ': 'none here',
           '#### -3.5 and 9': '-3.5', 'a 5 b 6,000 c': '6000'}
  assert {t: metrics.gsm8k_answer(t) for t in cases} == cases
  # lm-eval's gsm8k strict-match: its first '#### N', also when a generation runs on.
  strict = lm_eval_extraction.RegexFilter(r'#### (\-?[0-9\.\,]+)')
  ran_on = ['48 + 24 = 72 #### 72\n\nQuestion: and 5 more?\nAnswer: 77 #### 77', '#### 3 #### 4']
  assert [metrics.gsm8k_answer(t) for t in ran_on] == [
      r[0] for r in strict.apply([[t] for t in ran_on], [{}] * len(ran_on))] == ['72', '3']
  prompts = [tasks.Prompt('p', 'Natalia sold 48 + 24 = 72 clips #### 72')] * 2
  assert metrics.generation(['72', 'it is 71'], prompts) == {'exact_match': 0.5,
                                                            'num_examples': 2}
  assert metrics.generation(['X'], [tasks.Prompt('p', 'x')], str.lower)['exact_match'] == 1.0


@pytest.mark.parametrize('lines,needle', [
    (['{"context": "a", "choices": ["b", "c"], "answer": 0}', '{"context": "a", "choices"'],
     'line 2: not valid JSON'),
    (['{"context": "a", "choices": ["b", "c"], "answer": 0}', '{"context": "a", "answer": 1}'],
     'line 2: no "choices"'),
    (['{"context": "a", "choices": ["b", "c"], "answer": 2}'],
     'line 1: "answer" 2 is out of range for 2 choices'),
    (['{"prompt": "a", "answer": "b"}', '', '{"prompt": "a"}'], 'line 3: no "answer"'),
    (['{"question": "a"}'], 'line 1: keys [\'question\'] are neither'),
])
def test_bad_task_files_are_one_line(tmp_path, lines, needle):
  path = tmp_path / 't.jsonl'
  path.write_text('\n'.join(lines) + '\n')
  with pytest.raises(DataError) as e:
    tasks.read('t', str(path))
  assert f'{path}, {needle}' in str(e.value) and '\n' not in str(e.value), e.value


def test_bad_pairs_and_models_are_one_line(tmp_path, monkeypatch):
  with pytest.raises(DataError, match=r"task 'a': .*missing.jsonl is not a file"):
    tasks.load(f'a={tmp_path}/missing.jsonl')
  # Half an escaped emoji (a traceback at tokenizing); a BOM and '~' read as data.train_files
  # reads them (both were refused).
  row = {'context': 'smile \ud83d', 'choices': [' a', ' b'], 'answer': 0}
  (tmp_path / 'half.jsonl').write_text(json.dumps(row, ensure_ascii=True) + '\n')
  with pytest.raises(DataError, match=r'half.jsonl, line 1: context has an unpaired surrogate '
                                      r"'\\ud83d' at character 6"):
    tasks.load(f'a={tmp_path}/half.jsonl')
  (tmp_path / 'bom.jsonl').write_bytes(b'\xef\xbb\xbf' + json.dumps({**row, 'context': 'x'})
                                       .encode() + b'\n')
  monkeypatch.setenv('HOME', str(tmp_path))
  assert tasks.load('a=~/bom.jsonl')[0].examples[0].context == 'x'
  for spec, needle in (('a=x;b', "'b' is not NAME=PATH"), ('a=x;a=y', "names 'a' twice"),
                       ((('a', 'x'), ('a', 'y')), "names 'a' twice")):
    with pytest.raises(ConfigError, match=needle):
      tasks.pairs(spec)
  mc = _write(tmp_path / 'mc.jsonl', _questions()[:2])
  cfg = helpers.make_config(data__eval_tasks=(('arc', mc),), early_stop__metric='arc/accuracy',
                            eval_every_steps=1)
  setup_lib._check_metric_names(cfg, {'eval': None}, {'arc'})  # a task: a split to name
  with pytest.raises(ConfigError, match=r"names eval data 'arcx', .* \['arc', 'eval'\]"):
    setup_lib._check_metric_names(helpers.make_config(
        data__eval_tasks=f'arc={mc}', early_stop__metric='arcx/accuracy',
        eval_every_steps=1), {'eval': None}, {'arc'})
  with pytest.raises(ConfigError, match="model.name='mnist_mlp' .* is not one"):
    downstream.Downstream.build(cfg, object(), None)
  with pytest.raises(ConfigError, match="'eval', which is also an eval split"):
    downstream.Downstream.build(helpers.make_config(data__eval_tasks=f'eval={mc}'), object(),
                                None, ('eval',))


def test_a_bad_task_file_through_the_launcher_exits_2(tmp_path):
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"context": "a", "choices": ["b", "c"], "answer": 0}\n{"context": oops}\n')
  env = subprocess_env()
  proc = subprocess.run(
      [sys.executable, 'launch/train.py', '--config=launch/configs/llama.py',
       f'--workdir={tmp_path}/run', '--fake_devices=1', '--config.data.text.bytes=20000',
       '--config.data.eval_examples=8',
       f'--config.data.eval_tasks=mc={bad}'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=180, check=False)
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert errors == [f'error: DataError: {bad}, line 2: not valid JSON (Expecting value at column '
                    "13); write one JSON object per line"], errors

"""lm-evaluation-harness with the disttrain backend equals the harness's own `hf` backend.

One Hugging Face directory (a small random Llama and a byte-level BPE tokenizer that adds a BOS,
as Llama's, Mistral's and Gemma's do), three local YAML tasks over JSON-lines files (multiple
choice, rolling log-likelihood, greedy generation with a stop string and lm-eval's aliases:
max_new_tokens, a temperature that do_sample=False overrides), evaluated by
`lm_eval.simple_evaluate` twice: model='hf' (transformers on torch) and the disttrain backend on
8 devices. acc / acc_norm and each sample's log-likelihoods,
word perplexity, and the generated texts must agree.
"""

import json
import pathlib
import subprocess
import sys
import types

import lm_eval
import numpy as np
import pytest
import tokenizers
import torch
import transformers

import disttrain
from disttrain.data import tokenizer as tokenizer_lib
from disttrain.errors import ConfigError, DataError
from disttrain.evaluation import harness, harness_tasks, scoring
from disttrain.hf import trained as trained_lib
from disttrain.parallel import mesh as mesh_lib
from tests import helpers
from tests.conftest import ROOT, subprocess_env


MAX_LENGTH = 48  # scoring window: the rolling task's texts span several
WORDS = ('the cat sat on a mat and then the dog ran to the red house while seventeen birds sang '
         'def f(x): return x * 7 import os print hello world blue sky').split()
TASKS = {
    'mc': """task: local_mc
dataset_path: json
dataset_kwargs: {data_files: {test: DIR/mc.jsonl}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list: [{metric: acc}, {metric: acc_norm}]
""",
    'rolling': """task: local_rolling
dataset_path: json
dataset_kwargs: {data_files: {test: DIR/text.jsonl}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: bits_per_byte}]
""",
    'gen': """task: local_gen
dataset_path: json
dataset_kwargs: {data_files: {test: DIR/gen.jsonl}}
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: [" "], max_new_tokens: 10, do_sample: false, temperature: 0.7}
metric_list: [{metric: exact_match}]
""",
}


def _lines(path, rows) -> None:
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))


_MANAGERS = {}  # lm-eval indexes its 14,683 tasks in each TaskManager (13-16 s here)


def _listing(include_path) -> tuple:
  """The key of a TaskManager: every file under include_path (lm-eval reads **/*.yaml and what
  they include), by relative name and bytes."""
  root = pathlib.Path(include_path) if include_path else None
  files = sorted(p for p in root.rglob('*') if p.is_file()) if root else []
  return str(include_path), tuple((str(p.relative_to(root)), p.read_bytes()) for p in files)


def _reuse_task_managers(monkeypatch) -> None:
  """A TaskManager per state of the task directory: a test that writes a task gets a new one."""
  from lm_eval import tasks  # pylint: disable=g-import-not-at-top  (datasets & co.: on use)
  build = tasks.TaskManager
  def cached(*, include_path=None):  # harness_tasks passes include_path only
    key = _listing(include_path)
    if key not in _MANAGERS:
      _MANAGERS[key] = build(include_path=include_path)
    return _MANAGERS[key]
  monkeypatch.setattr(tasks, 'TaskManager', cached)


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  """The HF directory, the task directory, and both backends' results."""
  root = tmp_path_factory.mktemp('harness')
  rng = np.random.default_rng(0)
  text = lambda n: ' '.join(rng.choice(WORDS, size=n))
  hf_dir, task_dir = root / 'hf', root / 'tasks'
  hf_dir.mkdir(), task_dir.mkdir()
  tok = tokenizer_lib.train_bpe([text(40) for _ in range(200)], 300, str(hf_dir / 'tokenizer.json'))
  raw = tokenizers.Tokenizer.from_file(str(hf_dir / 'tokenizer.json'))  # a BOS, as Llama's adds
  raw.add_special_tokens(['<s>'])
  raw.post_processor = tokenizers.processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', raw.token_to_id('<s>'))])
  raw.save(str(hf_dir / 'tokenizer.json'))
  (hf_dir / 'tokenizer_config.json').write_text(json.dumps({
      'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|endoftext|>',
      'bos_token': '<s>', 'model_max_length': MAX_LENGTH}))
  tok = tokenizer_lib.load(str(hf_dir / 'tokenizer.json'))
  assert tok.encode('the cat')[0] == tok.bos_id != tok.eos_id
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      initializer_range=0.3, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id)
  transformers.LlamaForCausalLM(config).save_pretrained(str(hf_dir))
  questions = []
  for i in range(12):
    choices = [text(1 + (i + j) % 3) for j in range(3 + i % 2)]
    questions.append({'context': text(3 + i % 5) + (' ' if i % 2 else ':'), 'choices': choices,
                      'answer': int(rng.integers(len(choices)))})
  _lines(task_dir / 'mc.jsonl', questions)
  _lines(task_dir / 'text.jsonl', [{'text': text(10 + 15 * i)} for i in range(4)])
  _lines(task_dir / 'gen.jsonl', [{'prompt': text(4 + i), 'answer': 'cat'} for i in range(8)])
  for name, yaml in TASKS.items():
    (task_dir / f'{name}.yaml').write_text(yaml.replace('DIR', str(task_dir)))
  names = ['local_mc', 'local_rolling', 'local_gen']
  manager = harness_tasks.task_manager(names, str(task_dir))
  _MANAGERS[_listing(task_dir)] = manager
  reference = lm_eval.simple_evaluate(
      model='hf', model_args=f'pretrained={hf_dir},dtype=float32,max_length={MAX_LENGTH}',
      tasks=names, task_manager=manager, batch_size=4, log_samples=True, bootstrap_iters=0,
      device='cpu')
  lm = trained_lib.load(hf_dir=str(hf_dir))
  ours = harness.evaluate(lm, names, batch_size=8, max_length=MAX_LENGTH, log_samples=True,
                          manager=manager)
  return dict(reference=reference, ours=ours, lm=lm, hf_dir=hf_dir, task_dir=task_dir)


def test_generation_kwargs_read_as_lm_eval_normalizes_them():
  from lm_eval.models.utils import normalize_gen_kwargs  # pylint: disable=g-import-not-at-top
  for kwargs in [{'until': 'x', 'max_new_tokens': 5, 'do_sample': False, 'temperature': 0.7},
                 {'max_tokens': 7, 'max_completion_tokens': 9}, {'temperature': 0.5},
                 {'do_sample': True, 'max_gen_toks': 3, 'max_new_tokens': 4}, {}]:
    ref = normalize_gen_kwargs(kwargs, 11)
    assert harness_tasks.generation(kwargs, 11) == (ref['max_gen_toks'], ref['until'],
                                              ref['do_sample']), kwargs


def test_a_model_without_its_tokenizers_end_of_text_is_refused_with_the_fix():
  """launch/configs/llama.py's 256 byte ids stop short of the byte tokenizer's end of text (256):
  the docs' lm-eval example on such a run could never work; 257 ids can."""
  with pytest.raises(ConfigError, match=r"the tokenizer '\(bytes\)' has no end-of-text token "
                                        r'.* or train with model.vocab_size > 256 \(its id\)'):
    harness.backend(types.SimpleNamespace(max_len=64), tokenizer_lib.load(''), 256)
  assert harness.backend(types.SimpleNamespace(max_len=64), tokenizer_lib.load(''), 257).eos == 256


def _responses(results, task: str) -> list:
  return [s['filtered_resps'] for s in sorted(results['samples'][task], key=lambda s: s['doc_id'])]


@pytest.mark.slow  # lm-eval indexes its tasks (~10 s) and runs the hf backend
def test_same_scores_as_the_hf_backend(setup):
  ref, ours, lm = setup['reference'], setup['ours'], setup['lm']
  assert lm.mesh.size == 8
  mc_ref, mc = ref['results']['local_mc'], ours['results']['local_mc']
  assert (mc['acc,none'], mc['acc_norm,none']) == (mc_ref['acc,none'], mc_ref['acc_norm,none'])
  # float32 on both sides, different kernels: log-likelihoods within 1e-4 of each other
  lls_ref = np.array([[r[0] for r in doc] for doc in _responses(ref, 'local_mc')], dtype=object)
  lls = np.array([[r[0] for r in doc] for doc in _responses(ours, 'local_mc')], dtype=object)
  for a, b in zip(lls, lls_ref):
    np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), atol=1e-4)
  # acc differs from acc_norm on this data (choices of 1-3 words): both are really checked
  assert mc['acc,none'] != mc['acc_norm,none'] or len(set(map(len, lls))) > 1
  roll_ref, roll = ref['results']['local_rolling'], ours['results']['local_rolling']
  assert roll['word_perplexity,none'] == pytest.approx(roll_ref['word_perplexity,none'], rel=1e-5)
  assert roll['bits_per_byte,none'] == pytest.approx(roll_ref['bits_per_byte,none'], rel=1e-5)
  texts_ref, texts = _responses(ref, 'local_gen'), _responses(ours, 'local_gen')
  assert texts == texts_ref and len(set(map(str, texts))) >= 4, (texts, texts_ref)
  assert ours['results']['local_gen']['exact_match,none'] == \
      ref['results']['local_gen']['exact_match,none']


@pytest.mark.slow  # a fresh process imports lm_eval and indexes its tasks (~25 s)
def test_unknown_task_is_one_line_before_the_model_loads(setup, tmp_path, monkeypatch):
  _reuse_task_managers(monkeypatch)
  with pytest.raises(ConfigError, match=r"lm-eval knows no task 'local_mcq' \(its own tasks and "
                     r'those in .*\); list them with `lm_eval ls tasks`, or pass --include_path='):
    harness_tasks.task_manager(['local_mcq'], str(setup['task_dir']))
  # In the loop (evaluation/downstream.py) the fix is the config field, not lm-eval's flag.
  with pytest.raises(ConfigError, match=r'or pass --config.data.eval_harness_include=DIR'):
    harness_tasks.task_manager(['local_mcq'], None, '--config.data.eval_harness_include')
  with pytest.raises(ConfigError, match=r"the include path '.*/nodir' is not a directory"):
    harness_tasks.task_manager(['arc_easy'], str(tmp_path / 'nodir'))  # lm-eval skipped it silently
  env = subprocess_env()
  proc = subprocess.run(
      [sys.executable, '-m', 'disttrain', 'lm-eval', f'--hf_dir={tmp_path}/missing',
       '--tasks=definitely_not_a_task'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=180, check=False)
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
  assert errors[0].startswith("error: ConfigError: lm-eval knows no task 'definitely_not_a_task'")
  # Bad flags are one line too (tracebacks from numpy, range() and int(), exit 1).
  proc = subprocess.run(
      [sys.executable, '-m', 'disttrain', 'lm-eval', f'--hf_dir={setup["hf_dir"]}',
       '--tasks=local_mc', '--batch_size=0'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=180, check=False)
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      'error: ConfigError: --batch_size=0 must be >= 1; pass one, or leave it out for the '
      'default'], proc.stderr[-2000:]
  # A continuation longer than the window: a numpy broadcast traceback inside lm-eval.
  lm = setup['lm']
  scorer = scoring.Scorer(lm.model, mesh_lib.batch_sharding(lm.mesh), 8, 8, (0,))
  with pytest.raises(DataError, match='a continuation of 9 tokens is longer than the 8 tokens'):
    scorer.loglikelihoods(lm.params, {}, [([1, 2], [3] * 9)])
  assert trained_lib.parse_mesh(' data=-1, fsdp=2') == {'data': -1, 'fsdp': 2}
  for bad in ('data', 'data=abc', 'bogus=2'):
    with pytest.raises(ConfigError, match=f"--mesh='{bad}': '{bad}' is not AXIS=SIZE"):
      trained_lib.parse_mesh(bad)


@pytest.mark.slow  # an 8-device run
def test_in_the_loop_records_equal_the_hf_backend(setup, tmp_path, monkeypatch):
  """data.eval_harness in a run fine-tuning the same directory (one SGD step at 1e-12: the
  parameters do not move in float32) records the hf backend's acc, acc_norm and perplexity,
  sending the watchdog's heartbeat as it goes (it beat only around the whole harness, so an
  mmlu-sized eval was taken for a hang)."""
  beats, run = [], harness.run
  def counted(lm, *args, **kwargs):
    loop_beat = lm.beat
    lm.beat = lambda: (beats.append(1), loop_beat())
    return run(lm, *args, **kwargs)
  monkeypatch.setattr(harness, 'run', counted)
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'hf.py')
  helpers.override(cd, {
      'restore_from': str(setup['hf_dir']), 'data.name': 'text', 'data.text.bytes': 20_000,
      'data.seq_len': MAX_LENGTH, 'data.eval_examples': 8, 'global_batch_size': 8,
      'eval_batch_size': 8, 'precision.compute_dtype': 'float32', 'optimizer': 'sgd',
      'learning_rate': 1e-12, 'lr_schedule': 'constant', 'warmup_steps': 0,
      'num_train_steps': 1, 'log_every_steps': 1, 'eval_every_steps': 0,
      'checkpoint_every_steps': 0, 'data.eval_harness': 'local_mc,local_rolling',
      'data.eval_harness_include': str(setup['task_dir'])})
  result = disttrain.train(disttrain.from_config_dict(cd), str(tmp_path / 'run'))
  got = {r['split']: r for r in result.records if r['split'] in ('local_mc', 'local_rolling')}
  ref = setup['reference']['results']
  assert (got['local_mc']['acc'], got['local_mc']['acc_norm'], got['local_mc']['num_examples']) \
      == (ref['local_mc']['acc,none'], ref['local_mc']['acc_norm,none'], 12)
  assert got['local_rolling']['word_perplexity'] == pytest.approx(
      ref['local_rolling']['word_perplexity,none'], rel=1e-5)
  assert len(beats) >= 12 + 4, len(beats)  # at least each question's and text's encoding


@pytest.mark.slow  # the module's setup runs both backends (18 s): 27 s of the quick tier
def test_a_harness_task_generating_a_whole_row_is_refused_at_setup(setup, tmp_path, monkeypatch):
  """local_gen generates 10 tokens; rows of 10 leave no prompt. The run stops before its first
  step, naming data.seq_len (it stopped at the first eval, saying 'raise --max_length')."""
  _reuse_task_managers(monkeypatch)
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'hf.py')
  helpers.override(cd, {
      'restore_from': str(setup['hf_dir']), 'data.name': 'text', 'data.text.bytes': 2_000,
      'data.seq_len': 10, 'data.eval_examples': 8, 'global_batch_size': 8,
      'eval_batch_size': 8, 'data.eval_harness': 'local_mc,local_gen',
      'data.eval_harness_include': str(setup['task_dir'])})
  with pytest.raises(ConfigError, match=r"data.eval_harness task 'local_gen' generates 10 "
                     r'tokens, which leaves no room for a prompt in the 10 tokens a row holds '
                     r'\(data.seq_len\); generate fewer tokens'):
    disttrain.setup(disttrain.from_config_dict(cd), devices=helpers.devices(1))
  # A group's task named like a data.eval_tasks task: its record replaced the task's own.
  (setup['task_dir'] / 'local_group.yaml').write_text('group: local_group\ntask: [local_mc]\n')
  mc = tmp_path / 'mc.jsonl'
  mc.write_text(json.dumps({'context': 'a', 'choices': [' b', ' c'], 'answer': 0}) + '\n')
  helpers.override(cd, {'data.seq_len': 32, 'data.eval_harness': 'local_group',
                        'data.eval_tasks': f'local_mc={mc}'})
  with pytest.raises(ConfigError, match="data.eval_harness writes records named 'local_mc' \\(a "
                                        'task of one of its groups or tags\\)'):
    disttrain.setup(disttrain.from_config_dict(cd), devices=helpers.devices(1))
  # A tag (ai2_arc, mmlu's *_tasks are tags) lists its tasks apart from a group's: they were not
  # seen, so a tagged task generating a whole row passed setup, and best_metric had to name the
  # tag, which writes no record, and could not name its tasks, which do.
  (setup['task_dir'] / 'local_tagged.yaml').write_text(
      TASKS['gen'].replace('DIR', str(setup['task_dir'])).replace(
          'task: local_gen', 'task: local_tagged\ntag: [local_tag]'))
  helpers.override(cd, {'data.seq_len': 10, 'data.eval_harness': 'local_tag',
                        'data.eval_tasks': ''})
  with pytest.raises(ConfigError, match=r"data.eval_harness task 'local_tagged' generates 10 "):
    disttrain.setup(disttrain.from_config_dict(cd), devices=helpers.devices(1))
  helpers.override(cd, {'data.seq_len': 32, 'best_metric': 'local_tag/exact_match'})
  with pytest.raises(ConfigError, match=r"best_metric='local_tag/exact_match' names eval data "
                                        r"'local_tag', but the run evaluates \['eval', "
                                        r"'local_tagged'\]"):
    disttrain.setup(disttrain.from_config_dict(cd), devices=helpers.devices(1))
  helpers.override(cd, {'best_metric': 'local_tagged/exact_match'})
  disttrain.setup(disttrain.from_config_dict(cd), devices=helpers.devices(1))
  cd = disttrain.config.defaults()  # an MLP: the message named data.eval_tasks, not set here
  cd.data.eval_harness = 'local_mc'
  with pytest.raises(ConfigError, match=r'data.eval_harness scores a language model, .* or '
                     r'drop data.eval_harness'):
    disttrain.setup(disttrain.from_config_dict(cd), devices=helpers.devices(1))


def test_records_keep_each_filter_of_a_metric():
  """gsm8k scores exact_match under two filters (strict-match, flexible-extract): both are kept
  (the filter was dropped, so the last one silently won); a metric of filter none keeps its
  plain name. The results as lm_eval 0.4.13's simple_evaluate returns them."""
  results = {'results': {'gsm8k': {'alias': 'gsm8k', 'sample_len': 2,
                                   'exact_match,strict-match': 0.0,
                                   'exact_match_stderr,strict-match': 'N/A',
                                   'exact_match,flexible-extract': 1.0},
                         'arc_easy': {'acc,none': 0.5, 'acc_norm,none': 0.25}},
             'n-samples': {'gsm8k': {'effective': 2}, 'arc_easy': {'effective': 4}}}
  assert harness.records(results) == {
      'gsm8k': {'exact_match_strict-match': 0.0, 'exact_match_flexible-extract': 1.0,
                'num_examples': 2},
      'arc_easy': {'acc': 0.5, 'acc_norm': 0.25, 'num_examples': 4}}

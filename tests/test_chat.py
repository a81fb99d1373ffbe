"""Chat templates (disttrain/data/chat.py) against `transformers`' apply_chat_template.

Four template styles as the models ship them (ChatML as Qwen's, Llama 3's headers, Gemma's turns,
Phi-3's closing EOS), each written twice: plain, as published, and with `{% generation %}` blocks
around the assistant text and its end token, which transformers reads as the assistant mask. The
reference is transformers on the marked template (tokens and `assistant_masks`); disttrain renders
the plain one and must find the same tokens and the same trained tokens by itself, through the SFT
data pipeline (data.name=sft, the template in the tokenizer directory's tokenizer_config.json).
"""

import dataclasses
import json
import subprocess
import sys

import pytest

import disttrain
from disttrain import errors
from disttrain.data import chat, sources, tokenizer as tokenizer_lib
from tests import helpers
from tests.conftest import ROOT, SUBPROCESS_XLA_FLAGS

# [[ ]] mark the assistant text and its end token: removed (plain) or generation blocks (marked).
CHATML = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
          "{{ '<|im_start|>assistant\\n' }}[[{{ m['content'] + '<|im_end|>' }}]]{{ '\\n' }}"
          "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
          "{% if m['role'] == 'assistant' %}[[{{ m['content'] | trim + '<|eot_id|>' }}]]"
          "{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}"
         "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' }}{% if role == 'model' %}"
         "[[{{ m['content'] | trim + '<end_of_turn>' }}]]{{ '\\n' }}"
         "{% else %}{{ m['content'] | trim + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
# Phi-3.5's: the conversation closes with EOS when no generation prompt follows, so a turn rendered
# alone ends differently from the same turn with more after it.
PHI3 = ("{% for m in messages %}{% if m['role'] == 'system' and m['content'] %}"
        "{{ '<|system|>\\n' + m['content'] + '<|end|>\\n' }}{% elif m['role'] == 'user' %}"
        "{{ '<|user|>\\n' + m['content'] + '<|end|>\\n' }}{% elif m['role'] == 'assistant' %}"
        "{{ '<|assistant|>\\n' }}[[{{ m['content'] + '<|end|>' }}]]{{ '\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
        "{% else %}{{ eos_token }}{% endif %}")
STYLES = {'chatml': CHATML, 'llama3': LLAMA3, 'gemma': GEMMA, 'phi3': PHI3,
          'phi3small': '{{ bos_token }}' + PHI3}  # its BOS is its EOS: not part of the closing
SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|begin_of_text|>',
           '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>', '<bos>', '<eos>',
           '<start_of_turn>', '<end_of_turn>', '<s>', '<|system|>', '<|user|>', '<|assistant|>',
           '<|end|>']
CONVERSATIONS = [
    [{'role': 'user', 'content': 'What is 2 + 2?'}, {'role': 'assistant', 'content': 'It is 4.'}],
    [{'role': 'user', 'content': ' Tell me  a story '},
     {'role': 'assistant', 'content': 'Once upon a time, théré was a dragon.\n'},
     {'role': 'user', 'content': 'And then?'},
     {'role': 'assistant', 'content': 'It slept. 🐉 The end.'}],
    # Private-use characters in the data: no marks of ours to be mistaken for.
    [{'role': 'user', 'content': 'Echo \ue000 this'},
     {'role': 'assistant', 'content': '\ue001 echoed \ue000'}],
]


def plain(style: str) -> str:
  return STYLES[style].replace('[[', '').replace(']]', '')


def marked(style: str) -> str:
  return STYLES[style].replace('[[', '{% generation %}').replace(']]', '{% endgeneration %}')


@pytest.fixture(scope='module')
def tokenizer_dirs(tmp_path_factory):
  """A byte-level BPE trained here with every style's special tokens; one directory per style
  whose tokenizer_config.json carries the plain template, as a model's directory does."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  texts = [m['content'] for c in CONVERSATIONS for m in c] * 20 + ['user assistant model system']
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  out = {}
  for style in STYLES:
    folder = tmp_path_factory.mktemp(style)
    tok.save(str(folder / 'tokenizer.json'))
    bos, eos = {'chatml': (None, '<|im_end|>'), 'llama3': ('<|begin_of_text|>', '<|eot_id|>'),
                'gemma': ('<bos>', '<eos>'), 'phi3': ('<s>', '<|endoftext|>'),
                'phi3small': ('<|endoftext|>', '<|endoftext|>')}[style]
    (folder / 'tokenizer_config.json').write_text(json.dumps({
        'bos_token': bos, 'eos_token': eos, 'chat_template': plain(style),
        'tokenizer_class': 'PreTrainedTokenizerFast'}))
    out[style] = folder
  return out


def _reference(folder, style: str, conversation: list) -> tuple[list[int], list[int]]:
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
  config = json.loads((folder / 'tokenizer_config.json').read_text())
  hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / 'tokenizer.json'),
                               bos_token=config['bos_token'], eos_token=config['eos_token'])
  out = hf.apply_chat_template(conversation, chat_template=marked(style), tokenize=True,
                               return_dict=True, return_assistant_tokens_mask=True)
  plain_ids = hf.apply_chat_template(conversation, chat_template=plain(style), tokenize=True,
                                     return_dict=True)['input_ids']
  assert plain_ids == out['input_ids']  # the marks change nothing but the mask
  assert 0 < sum(out['assistant_masks']) < len(out['input_ids'])
  return list(out['input_ids']), list(out['assistant_masks'])


@pytest.mark.parametrize('style', list(STYLES))
def test_sft_rows_equal_apply_chat_template_and_train_the_assistant_tokens(
    tokenizer_dirs, style, tmp_path):
  folder = tokenizer_dirs[style]
  train = tmp_path / 'train.jsonl'
  train.write_text(''.join(json.dumps({'messages': c}) + '\n' for c in CONVERSATIONS * 3))
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  cfg = disttrain.from_config_dict(helpers.override(cd, {
      'data.name': 'sft', 'data.train_files': str(train), 'data.eval_examples': 2,
      'data.tokenizer': str(folder), 'model.vocab_size': 512, 'data.seq_len': 64}))
  docs = sources.build(cfg)['train_data'].docs
  tokenizer = tokenizer_lib.load(str(folder))
  for i, conversation in enumerate(CONVERSATIONS):
    want_ids, want_mask = _reference(folder, style, conversation)
    ids, mask = docs.tokens(i)
    assert ids.tolist() == want_ids, (style, tokenizer.decode(ids), tokenizer.decode(want_ids))
    trained = lambda m: tokenizer.decode([t for t, k in zip(want_ids, m) if k])
    assert mask.tolist() == want_mask, (style, trained(mask), trained(want_mask))
    # The template's own generation blocks, when it has them, give the same.
    template = chat.ChatTemplate(marked(style), 'marked', chat.special_tokens(
        str(folder / 'tokenizer.json')))
    assert tokenizer.encode_whole(template.pieces(conversation, 'x')) == (want_ids, want_mask)


def test_conversational_preference_pairs_are_the_templates_rows(tokenizer_dirs, tmp_path):
  """DPO's pairs in TRL's conversational form: each row is apply_chat_template of the prompt
  turns and the chosen (or rejected) turn, that turn trained, not the prompt's own assistant turn
  (data.name=preference)."""
  folder = tokenizer_dirs['llama3']
  conversation = CONVERSATIONS[1]
  rejected = {'role': 'assistant', 'content': 'It flew away.'}
  train = tmp_path / 'pairs.jsonl'
  line = {'prompt': conversation[:-1], 'chosen': conversation[-1:], 'rejected': [rejected]}
  train.write_text(json.dumps(line) + '\n' + json.dumps({'prompt': 'x', 'chosen': 'y'}) + '\n')
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  cfg = disttrain.from_config_dict(helpers.override(cd, {
      'data.name': 'preference', 'data.train_files': str(train), 'data.eval_examples': -1,
      'data.tokenizer': str(folder), 'model.vocab_size': 512, 'data.seq_len': 96}))
  with pytest.raises(errors.DataError, match=f"{train} line 2: a preference line needs 'chosen' "
                     "and 'rejected', this one has no 'rejected'"):
    sources.build(cfg)
  train.write_text(json.dumps(line) + '\n')
  rows = sources.build(cfg)['train_data']
  for k, last in enumerate((conversation[-1], rejected)):
    ids, mask = _reference(folder, 'llama3', conversation[:-1] + [last])
    prompt = _reference(folder, 'llama3', conversation[:-2])[0]  # through the first answer
    mask = [0] * len(prompt) + mask[len(prompt):]
    assert sum(mask) > 0
    n = len(ids) - 1
    assert rows['tokens'][0, k, :n].tolist() == ids[:-1]
    assert rows['targets'][0, k, :n].tolist() == ids[1:] and (rows['targets'][0, k, n:] == -1).all()
    assert rows['loss_mask'][0, k, :n].tolist() == mask[1:]


# Llama 3.1's tool-call test and Qwen3's reasoning field, as their published templates read them.
FIELDS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if 'tool_calls' in m %}{{ m.tool_calls|length }} calls{% endif %}"
          "{% if m.reasoning_content is string %}<think>{{ m.reasoning_content }}</think>"
          "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}")


def test_messages_reach_the_template_as_transformers_passes_them(tokenizer_dirs):
  """Fields set to null (an OpenAI export's "tool_calls": null) crashed a template that tests for
  them, a TypeError traceback; a trace under 'reasoning' or 'thinking' (vLLM's, gpt-oss's names)
  was dropped, so SFT trained an empty think block."""
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
  folder = tokenizer_dirs['chatml']
  hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / 'tokenizer.json'), eos_token='<|im_end|>')
  template = chat.ChatTemplate(FIELDS, 'fields', chat.special_tokens(str(folder / 'tokenizer.json')))
  for field in ('reasoning', 'thinking', 'reasoning_content'):
    conversation = [{'role': 'user', 'content': 'What is 2 + 2?', 'name': None},
                    {'role': 'assistant', 'content': 'It is 4.', 'tool_calls': None,
                     field: 'two and two'}]
    want = hf.apply_chat_template(conversation, chat_template=FIELDS, tokenize=False)
    assert '<think>two and two</think>' in want and ' calls' not in want
    assert template.render(conversation) == want, field


@pytest.mark.slow  # a launcher subprocess
def test_a_template_that_fails_is_one_line_naming_the_example(tokenizer_dirs, tmp_path):
  """Gemma's template refuses a system turn: the run stops in one line, exit 2."""
  train = tmp_path / 'train.jsonl'
  bad = [{'role': 'system', 'content': 'be brief'}, *CONVERSATIONS[0]]
  train.write_text(''.join(json.dumps({'messages': c}) + '\n' for c in [CONVERSATIONS[0], bad]))
  env = {'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': SUBPROCESS_XLA_FLAGS, 'PATH': '/usr/bin:/bin'}
  proc = subprocess.run(
      [sys.executable, '-m', 'disttrain', 'train', '--config=launch/configs/llama.py',
       f'--workdir={tmp_path / "run"}', '--config.data.name=sft',
       f'--config.data.train_files={train}', '--config.data.eval_examples=1',
       f'--config.data.tokenizer={tokenizer_dirs["gemma"]}', '--config.model.vocab_size=512'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
  assert f'{train} line 2: the chat template in' in errors[0], errors[0]
  assert 'System role not supported' in errors[0], errors[0]


@pytest.mark.slow  # a generate subprocess
def test_generate_chat_prompts_are_the_templates_generation_prompt(tokenizer_dirs, tmp_path):
  """`disttrain generate --chat`: each prompt a user turn with the generation prompt, tokens as
  apply_chat_template(add_generation_prompt=True) makes them; greedy continuations as
  transformers' own from those tokens, stopping where transformers does at any of
  generation_config.json's eos_token_id list (an instruct model's end of turn besides its EOS)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  folder = tmp_path / 'model'
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
  folder.mkdir()
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (folder / name).write_bytes((tokenizer_dirs['chatml'] / name).read_bytes())
  prompts = ['What is 2 + 2?', 'Tell me a story']
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / 'tokenizer.json'))
  end = hf.convert_tokens_to_ids('<|im_end|>')  # tokenizer_config.json's eos_token
  ids = [list(hf.apply_chat_template([{'role': 'user', 'content': p}], chat_template=plain(
      'chatml'), add_generation_prompt=True, tokenize=True, return_dict=True)['input_ids'])
         for p in prompts]
  greedy = lambda row, **kw: model.generate(torch.tensor([row]), max_new_tokens=6,
                                            do_sample=False, **kw)[0, len(row):].tolist()
  with torch.no_grad():
    free = greedy(ids[0], eos_token_id=end)
  # The second stop id: the first token of prompt 0's free continuation not seen before it.
  second = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i] and t != end)
  model.generation_config.eos_token_id = [end, second]
  model.save_pretrained(folder)  # with generation_config.json, as instruct models ship
  env = {'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': SUBPROCESS_XLA_FLAGS, 'PATH': '/usr/bin:/bin'}
  # The tokenizer from elsewhere (no generation_config.json there): the stops are the model's.
  proc = subprocess.run(
      [sys.executable, '-m', 'disttrain', 'generate', f'--hf_dir={folder}', '--chat',
       f'--tokenizer={tokenizer_dirs["chatml"]}', *[f'--prompt={p}' for p in prompts],
       '--max_new_tokens=6', '--json=-'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert out['stop_ids'] == [end, second]
  for row, sample in zip(ids, out['samples']):
    assert sample['prompt_tokens'] == row
    with torch.no_grad():
      new = greedy(row)  # transformers' generate reads the saved generation_config.json
    assert sample['tokens'] == (new[:-1] if new[-1] in (end, second) else new), (sample, new)
  assert out['samples'][0]['stop'] == 'eos'  # at `second`, before max_new_tokens
  # Without generation_config.json (older saves), transformers derives it from config.json.
  (folder / 'generation_config.json').unlink()
  model.config.eos_token_id = [end, second]
  model.config.save_pretrained(folder)
  derived = transformers.GenerationConfig.from_model_config(
      transformers.AutoConfig.from_pretrained(folder)).eos_token_id
  assert tokenizer_lib.load(str(folder)).stop_ids(400) == tuple(derived) == (end, second)
  # special_tokens_map.json's names win over tokenizer_config.json's in an older save, and are
  # ignored beside an added_tokens_decoder: as transformers reads them.
  (folder / 'special_tokens_map.json').write_text(json.dumps({'bos_token': '<|im_end|>'}))
  config = json.loads((folder / 'tokenizer_config.json').read_text())
  for modern in (False, True):
    written = {**config, 'bos_token': '<|im_start|>'}
    if modern:
      written['added_tokens_decoder'] = {}
    (folder / 'tokenizer_config.json').write_text(json.dumps(written))
    theirs = transformers.AutoTokenizer.from_pretrained(folder).bos_token
    assert chat.special_tokens(str(folder / 'tokenizer.json'))['bos_token'] == theirs == (
        '<|im_start|>' if modern else '<|im_end|>')


PAIRS = [{'prompt': 'Q: x = f(', 'completion': 'y) means?\nA: a call'},
         {'prompt': 'Tell me a story.', 'completion': ' Once upon a time, théré was a dragon.'},
         # Characters no tokenizer below trained on: SentencePiece spells them in byte tokens.
         {'prompt': 'Name it:', 'completion': ' 🦞Ω!'}]


@pytest.fixture(scope='module')
def sentencepiece_dirs(tmp_path_factory):
  """Llama 2 / Mistral style tokenizers trained here: a tokenizer.json with a Metaspace
  pre-tokenizer and a SentencePiece .model with byte fallback, both prefixing words with '▁'."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  texts = [m['content'] for c in CONVERSATIONS for m in c] + [v for p in PAIRS[:2]
                                                              for v in p.values()]
  metaspace = tmp_path_factory.mktemp('metaspace')
  tok = Tokenizer(models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme='first')
  tok.decoder = decoders.Metaspace(prepend_scheme='first')
  tok.train_from_iterator(texts * 20, trainers.BpeTrainer(
      vocab_size=300, special_tokens=['<unk>', '<s>', '</s>']))
  tok.save(str(metaspace / 'tokenizer.json'))
  (metaspace / 'tokenizer_config.json').write_text(json.dumps({
      'bos_token': '<s>', 'eos_token': '</s>', 'tokenizer_class': 'PreTrainedTokenizerFast'}))
  model = tmp_path_factory.mktemp('spm')
  spm.SentencePieceTrainer.train(sentence_iterator=iter(texts * 20), model_prefix=str(
      model / 'tokenizer'), vocab_size=400, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
      hard_vocab_limit=False, byte_fallback=True, minloglevel=2)  # as Llama 2's
  return {'metaspace': metaspace, 'sentencepiece': model / 'tokenizer.model'}


def _pair_reference(path, pair: dict) -> tuple[list[int], list[int]]:
  """TRL's prompt-completion rows: the joined text encoded once with the tokenizer's specials,
  EOS after; trained from the end of the prompt's own encoding on."""
  if str(path).endswith('.model'):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    sp = spm.SentencePieceProcessor(model_file=str(path))
    encode, eos = lambda text: [sp.bos_id()] + sp.EncodeAsIds(text), sp.eos_id()
  else:
    from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
    config = json.loads((path / 'tokenizer_config.json').read_text())
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / 'tokenizer.json'),
                                 bos_token=config['bos_token'], eos_token=config['eos_token'])
    encode, eos = lambda text: hf(text)['input_ids'], hf.eos_token_id
  ids, prompt = encode(pair['prompt'] + pair['completion']), encode(pair['prompt'])
  assert ids[:len(prompt)] == prompt
  return ids + [eos], [0] * len(prompt) + [1] * (len(ids) + 1 - len(prompt))


def test_prompt_completion_pairs_are_trls_rows_with_any_tokenizer(tokenizer_dirs,
                                                                  sentencepiece_dirs, tmp_path):
  """Plain pairs (data.name=sft and preference) are the joined text encoded once and ended with
  a trained EOS. Each piece was encoded apart (a '▁' SentencePiece added at the completion's
  start), and with a chat template in the directory the pairs lost their EOS."""
  train = tmp_path / 'train.jsonl'
  train.write_text(''.join(json.dumps(p) + '\n' for p in PAIRS * 2))
  pairs = tmp_path / 'pairs.jsonl'
  pairs.write_text(''.join(json.dumps({'prompt': p['prompt'], 'chosen': p['completion'],
                                       'rejected': ' no.'}) + '\n' for p in PAIRS))
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  for path in (tokenizer_dirs['chatml'], *sentencepiece_dirs.values()):
    cfg = disttrain.from_config_dict(helpers.override(cd, {
        'data.name': 'sft', 'data.train_files': str(train), 'data.eval_examples': 0,
        'data.tokenizer': str(path), 'model.vocab_size': 512, 'data.seq_len': 64}))
    docs = sources.build(cfg)['train_data'].docs
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, name='preference', train_files=str(pairs)))
    rows = sources.build(cfg)['train_data']
    for i, pair in enumerate(PAIRS):
      want_ids, want_mask = _pair_reference(path, pair)
      ids, mask = docs.tokens(i)
      assert (ids.tolist(), mask.tolist()) == (want_ids, want_mask), (path, ids, want_ids)
      n = len(want_ids) - 1
      assert rows['tokens'][i, 0, :n].tolist() == want_ids[:-1]
      assert rows['loss_mask'][i, 0, :n].tolist() == want_mask[1:]

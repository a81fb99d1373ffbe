"""Text in, tokens out: tokenizers, raw-text readers, packing, supervised fine-tuning masks.

The corpus is the Python standard library's modules (data/docs as docs/language-models.md converts them,
made here in a temporary folder) with a byte-level BPE tokenizer trained on it, as a user would.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import disttrain
from disttrain import data
from disttrain.data import formats, packing, sources, text, tokenizer as tokenizer_lib
from disttrain.errors import DataError
from tests import helpers
from tests.conftest import ROOT, subprocess_env
from tests.helpers import devices


def _env() -> dict:
  return subprocess_env()


def _cli(*args: str) -> str:
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc.stdout


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """data/docs (JSON lines of the standard library's modules) and a 1,024-token BPE tokenizer,
  made by the docs' commands."""
  out = tmp_path_factory.mktemp('docs')
  _cli('-m', 'disttrain', 'convert', '--source=text', '--format=jsonl', '--eval_documents=8',
       f'--out={out}')
  line = _cli('-m', 'disttrain', 'tokenizer', f'--input={out}/train.jsonl', '--vocab_size=1024',
              f'--out={out}/tokenizer.json')
  assert 'trained a 1,024-token byte-level BPE tokenizer' in line
  return out


def test_tokenizers_round_trip_and_know_their_end_of_sequence(corpus, tmp_path):
  import sentencepiece  # pylint: disable=g-import-not-at-top  (the text extra)
  docs = text.Documents([str(corpus / 'train.jsonl')])
  (tmp_path / 'lines.txt').write_text('\n'.join(docs[i][:2000] for i in range(40)))
  sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / 'lines.txt'),
                                           model_prefix=str(tmp_path / 'sp'), vocab_size=300,
                                           minloglevel=2)
  sample = 'def main():\n    return "héllo"  # ünïcode\n'
  for path, vocab in ((str(corpus / 'tokenizer.json'), 1024), (str(tmp_path / 'sp.model'), 300),
                      ('', 257)):
    tok = tokenizer_lib.load(path)
    assert tok.vocab_size == vocab and tok.eos_id is not None
    ids = tok.encode(sample)
    assert max(ids) < vocab and tok.eos_id not in ids
    decoded = tok.decode(ids)
    assert decoded.replace(' ', '') == sample.replace(' ', '') or tok.kind == 'sentencepiece'
    # The text new tokens add after a prompt (disttrain generate's): a SentencePiece word's
    # leading space is there only when decoded with what comes before it.
    prompt, new = tok.encode('def main():'), tok.encode(' return x', special=False)
    assert tok.continuation(prompt, new) == ' return x', (path, tok.decode(new))
  assert tokenizer_lib.load(str(corpus / 'tokenizer.json')).eos_id == 0  # <|endoftext|>
  assert tokenizer_lib.load(str(corpus)).file.endswith('tokenizer.json')  # a directory works
  typo = tmp_path / 'typo'  # an eos_token the vocabulary lacks: it said none was named
  typo.mkdir()
  shutil.copy(corpus / 'tokenizer.json', typo)
  (typo / 'tokenizer_config.json').write_text('{"eos_token": "<|endoftex|>"}')
  with pytest.raises(DataError, match=r"names eos_token '<\|endoftex\|>', which .* does not "
                                      r'have; fix the name'):
    tokenizer_lib.load(str(typo))
  legacy = tmp_path / 'legacy'  # names kept only in special_tokens_map.json, as older saves do
  legacy.mkdir()
  shutil.copy(corpus / 'tokenizer.json', legacy)
  assert tokenizer_lib.load(str(legacy)).bos_id is None
  (legacy / 'special_tokens_map.json').write_text(
      '{"bos_token": {"content": "<|endoftext|>", "lstrip": false}}')
  assert tokenizer_lib.load(str(legacy)).bos_id == 0  # transformers' bos_token_id too


def test_a_tokenizer_that_appends_eos_itself_gets_one_eos_per_document(corpus, tmp_path):
  """A post-processor '$A </s>' (T5; Llama with add_eos_token): documents and SFT pairs ended
  in two EOS, the tokenizer's untrained. Now the ids are the tokenizer's own encoding."""
  from tokenizers import Tokenizer, processors  # pylint: disable=g-import-not-at-top
  from disttrain.data import packing  # pylint: disable=g-import-not-at-top
  raw = Tokenizer.from_file(str(corpus / 'tokenizer.json'))
  raw.post_processor = processors.TemplateProcessing(single='$A <|endoftext|>',
                                                     special_tokens=[('<|endoftext|>', 0)])
  (tmp_path / 'eos').mkdir()
  raw.save(str(tmp_path / 'eos' / 'tokenizer.json'))
  tok = tokenizer_lib.load(str(tmp_path / 'eos'))
  assert tok.eos_id == 0
  docs = ['def f(x):\n    return x', '']
  for (ids, _), doc in zip(packing._encode(docs, 0, 2, tok, sft=False), docs):  # pylint: disable=protected-access
    assert ids == raw.encode(doc).ids and ids[-1] == 0 and ids.count(0) == 1
  ids, mask = tok.encode_pieces([('Q: 2+2?', False), (' A: 4', True)])
  assert ids == raw.encode('Q: 2+2? A: 4').ids and mask[-1] == 1 and len(mask) == len(ids)


def test_a_tokenizer_saved_with_truncation_and_padding_encodes_whole_documents(corpus, tmp_path):
  """tokenizer.json keeps truncation and padding settings: every document was cut to 8 ids and
  short ones padded with EOS ids (so no EOS was added). transformers turns both off per call."""
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  raw = Tokenizer.from_file(str(corpus / 'tokenizer.json'))
  raw.enable_truncation(8)
  raw.enable_padding(pad_id=0, pad_token='<|endoftext|>', length=8)
  (tmp_path / 'cut').mkdir()
  raw.save(str(tmp_path / 'cut' / 'tokenizer.json'))
  whole = Tokenizer.from_file(str(corpus / 'tokenizer.json'))
  tok = tokenizer_lib.load(str(tmp_path / 'cut'))
  docs = ['def f(x):\n    return x + 1  # a document longer than eight ids', 'hi']
  want = [whole.encode(doc).ids + [0] for doc in docs]  # each document, then its EOS
  assert [ids for ids, _ in packing._encode(docs, 0, 2, tok, sft=False)] == want  # pylint: disable=protected-access
  assert len(want[0]) > 8 and len(want[1]) < 8  # longer than the cut, shorter than the padding


def test_a_conversion_that_fails_midway_leaves_no_token_file(corpus, tmp_path):
  """train.bin was opened first and written as it went: a bad line later left a partial file
  that packing=concat reads without complaint. Now it is renamed into place when whole."""
  from disttrain.data.records import Slice  # pylint: disable=g-import-not-at-top
  (tmp_path / 'd.jsonl').write_text('{"text": "one"}\n{"text": "two"}\n{"text": oops}\n')
  docs = text.Documents([str(tmp_path / 'd.jsonl')])
  tok = tokenizer_lib.load(str(corpus / 'tokenizer.json'))
  with pytest.raises(DataError, match='d.jsonl line 3 is not JSON'):
    packing.tokenize(docs, tok, 'train', 1024, str(tmp_path / 'train.bin'), verbose=False)
  assert [p.name for p in tmp_path.iterdir()] == ['d.jsonl']
  written = packing.tokenize(Slice(docs, 0, 2), tok, 'train', 1024, str(tmp_path / 'train.bin'),
                             verbose=False)
  assert written.tokens(1)[0].tolist() == tok.encode('two') + [tok.eos_id]
  assert {p.name for p in tmp_path.iterdir()} == {'d.jsonl', 'train.bin', 'train.bin.docs.npy'}


def test_documents_from_txt_jsonl_and_parquet(tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (the text extra)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  (tmp_path / 'a.txt').write_bytes(b'\xef\xbb\xbffirst file\nstill the first')  # a BOM: no text
  # CRLF line ends, a blank line and one of spaces and a tab: not documents.
  (tmp_path / 'b.jsonl').write_bytes(b'{"text": "one"}\r\n\r\n \t\n{"text": "two", "id": 2}\r\n')
  pq.write_table(pa.table({'body': ['p0', 'p1', 'p2']}), tmp_path / 'c.parquet', row_group_size=2)
  docs = text.Documents([str(tmp_path / 'a.txt'), str(tmp_path / 'b.jsonl')])
  assert [docs[i] for i in range(len(docs))] == ['first file\nstill the first', 'one', 'two']
  parquet = text.Documents([str(tmp_path / 'c.parquet')], text_field='body')
  assert [parquet[i] for i in (2, 0, 1)] == ['p2', 'p0', 'p1']
  # A null text (exported datasets hold them) is one line naming the row and how to drop it.
  pq.write_table(pa.table({'text': ['p0', None]}), tmp_path / 'n.parquet')
  with pytest.raises(DataError, match=r"n.parquet row 1: column 'text' is null .*"
                                     r"filter\(table\['text'\]\.is_valid"):
    text.Documents([str(tmp_path / 'n.parquet')])[1]  # pylint: disable=expression-not-assigned
  # Not Parquet, a folder named like a text file: one line each (a pyarrow or OS traceback).
  (tmp_path / 'd.parquet').write_bytes(b'not parquet at all')
  with pytest.raises(DataError, match=r'd.parquet is not a readable Parquet file \(.*magic'):
    text.Documents([str(tmp_path / 'd.parquet')])
  (tmp_path / 'f.txt').write_bytes('café'.encode('latin-1'))  # was trained on as U+FFFD
  with pytest.raises(DataError, match=r'f.txt is not UTF-8 text: byte 3 is 0xe9 .*; convert'):
    text.Documents([str(tmp_path / 'f.txt')])[0]  # pylint: disable=expression-not-assigned
  (tmp_path / 'e.txt').mkdir()
  with pytest.raises(DataError, match=r'--input: .*e.txt is a directory; pass files'):
    text.resolve(str(tmp_path / '*.txt'), '--input')


def test_bad_json_lines_name_the_file_and_line(tmp_path):
  (tmp_path / 'd.jsonl').write_text('{"text": "ok"}\n{"text": "ok"\n{"body": "no text"}\n'
                                     '{"text": null}\n{"text": 3}\n')
  docs = text.Documents([str(tmp_path / 'd.jsonl')])
  for line, message in ((2, ' is not JSON'), (3, r" has no field 'text' \(it has \['body'\]\)"),
                        (4, r": field 'text' is null .*select\(\.\[\"text\"\] != null\)"),
                        (5, r": field 'text' is int, not text; pick")):
    with pytest.raises(DataError, match=f'd.jsonl line {line}{message}'):
      docs[line - 1]  # pylint: disable=pointless-statement
  # JSON lines read whole (preference pairs, GRPO prompts): a Latin-1 line was a traceback.
  (tmp_path / 'p.jsonl').write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
  with pytest.raises(DataError, match=r'p.jsonl line 2 is not UTF-8 \(invalid continuation '
                     r'byte at byte 15\); re-encode'):
    list(formats.json_lines([str(tmp_path / 'p.jsonl')], 'prompts'))
  # A lone surrogate escape is valid JSON and no text: every tokenizer raised its own traceback.
  (tmp_path / 'u.jsonl').write_text('{"text": "\\ud83d\\ude00"}\n'
                                    '{"text": "half \\ud83d of an emoji"}\n'
                                    '{"n": ' + '9' * 5000 + '}\n')
  assert text.Documents([str(tmp_path / 'u.jsonl')])[0] == '😀'  # a whole escaped pair is text
  with pytest.raises(DataError, match=r'u.jsonl line 3 is not JSON \(Exceeds the limit'):
    text.Documents([str(tmp_path / 'u.jsonl')])[2]  # pylint: disable=expression-not-assigned
  with pytest.raises(DataError, match=r'u.jsonl line 2 holds a lone UTF-16 surrogate escape'):
    text.Documents([str(tmp_path / 'u.jsonl')])[1]  # pylint: disable=expression-not-assigned
  with pytest.raises(DataError, match=r'u.jsonl line 2 holds a lone UTF-16 surrogate escape'):
    list(formats.json_lines([str(tmp_path / 'u.jsonl')], 'prompts'))
  # A BOM (Windows editors) before the first line, read alike by every JSON-lines reader; and
  # overlapping globs read each file once (they read it twice).
  (tmp_path / 'b.jsonl').write_bytes(b'\xef\xbb\xbf{"prompt": "a", "text": "t"}\n')
  assert [v for _, v in formats.json_lines([str(tmp_path / 'b.jsonl')], 'x')] == [
      {'prompt': 'a', 'text': 't'}]
  assert text.Documents(formats.resolve_files(f'{tmp_path}/b.jsonl,{tmp_path}/b*.jsonl', 'f'))[
      0] == 't'
  assert formats.resolve_files(f'{tmp_path}/b.jsonl,{tmp_path}/b*.jsonl', 'f') == [
      str(tmp_path / 'b.jsonl')]
  # A .json file of one array (Alpaca's data) was 'line 1 is not JSON; fix the line'.
  (tmp_path / 'alpaca.json').write_text('[\n  {"text": "a"},\n  {"text": "b"}\n]\n')
  with pytest.raises(DataError, match=r"alpaca.json line 1 opens a JSON array; .* jq -c"):
    text.Documents([str(tmp_path / 'alpaca.json')])[0]  # pylint: disable=expression-not-assigned
  (tmp_path / 'one.json').write_text('[{"prompt": "a"}, {"prompt": "b"}]\n')
  with pytest.raises(DataError, match=r"one.json line 1 is a JSON array; .* jq -c"):
    list(formats.json_lines([str(tmp_path / 'one.json')], 'prompts'))
  # A conversation with no assistant turn trained its EOS alone: 'stop after the user'.
  (tmp_path / 's.jsonl').write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
  with pytest.raises(DataError, match=r"s.jsonl line 1: 'messages' has no assistant turn, so "
                     r"nothing to train on \(roles \['user'\]\); add the reply"):
    text.Conversations([str(tmp_path / 's.jsonl')])[0]  # pylint: disable=expression-not-assigned


class _Docs:
  """Synthetic tokenized documents: lengths drawn by the test, ids (doc, position)-dependent."""

  def __init__(self, lengths):
    self.lengths, self.sft = np.asarray(lengths, np.int64), False

  def __len__(self):
    return len(self.lengths)

  def tokens(self, i):
    return (100_000 * i + np.arange(self.lengths[i])).astype(np.int32), None


def test_document_packing_covers_every_pair_once_and_wastes_under_5_percent():
  """A corpus of varied lengths (log-normal, median 300 tokens, 5 to 20,000): best fit decreasing
  into rows of 1,024 wastes 0.21 % of the row tokens (measured; the bound is 5 %)."""
  rng = np.random.default_rng(0)
  docs = _Docs(np.clip(rng.lognormal(np.log(300), 1.2, 3000), 5, 20_000).astype(int))
  rows = packing.PackedDocuments(docs, 1024)
  assert rows.padding_fraction < 0.05, rows.padding_fraction
  seen = {}
  for r in range(len(rows)):
    row = rows[r]
    for segment in range(1, row['segment_ids'].max() + 1):
      at = row['segment_ids'] == segment
      tokens, targets, positions = row['tokens'][at], row['targets'][at], row['positions'][at]
      doc, start = divmod(int(tokens[0]), 100_000)
      np.testing.assert_array_equal(tokens, 100_000 * doc + start + np.arange(at.sum()))
      np.testing.assert_array_equal(targets, tokens + 1)  # the next token of the same document
      np.testing.assert_array_equal(positions, np.arange(at.sum()))  # restart per piece
      seen[doc] = seen.get(doc, 0) + int(at.sum())
    assert (row['targets'][row['segment_ids'] == 0] == -1).all()  # padding counts for nothing
  assert seen == {d: int(n) - 1 for d, n in enumerate(docs.lengths) if n > 1}
  print(f'packing padding: {100 * rows.padding_fraction:.2f} %')


def test_real_text_packs_under_5_percent_and_concat_is_the_joined_stream(corpus):
  cfg = _config(corpus, **{'data.packing': 'documents', 'data.seq_len': 256})
  packed = sources.build(cfg)['train_data']
  assert packed.padding_fraction < 0.05
  concat = sources.build(_config(corpus, **{'data.seq_len': 256}))['train_data']
  stream = np.concatenate([concat.docs.tokens(i)[0] for i in range(len(concat.docs))])
  for k in (0, 7, len(concat) - 1):
    window = stream[k * 256:k * 256 + 257]
    np.testing.assert_array_equal(concat[k]['tokens'], window[:-1])
    np.testing.assert_array_equal(concat[k]['targets'], window[1:])


@pytest.mark.slow
def test_converted_token_files_give_the_on_the_fly_rows(corpus, tmp_path):
  # An earlier conversion's files in --out (an eval split, an SFT mask) were left beside the new
  # ones and read with them.
  for stale in ('eval.bin', 'eval.bin.docs.npy', 'train.bin.mask.bin'):
    (tmp_path / stale).write_bytes(b'\0\0')
  _cli('-m', 'disttrain', 'convert', '--source=documents', f'--input={corpus}/train.jsonl',
       f'--tokenizer={corpus}/tokenizer.json', '--format=tokens', f'--out={tmp_path}')
  assert sorted(p.name for p in tmp_path.iterdir()) == ['train.bin', 'train.bin.docs.npy']
  on_the_fly = sources.build(_config(corpus, **{'data.packing': 'documents',
                                                'data.eval_files': ''}))['train_data']
  from_files = sources.build(_config(corpus, **{
      'data.name': 'tokens', 'data.packing': 'documents', 'data.eval_files': '',
      'data.train_files': str(tmp_path / 'train.bin')}))['train_data']
  assert len(on_the_fly) == len(from_files)
  for r in (0, 5, len(from_files) - 1):
    for key, value in on_the_fly[r].items():
      np.testing.assert_array_equal(from_files[r][key], value)


def _config(corpus, **overrides) -> disttrain.Config:
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  base = {'data.name': 'documents', 'data.train_files': str(corpus / 'train.jsonl'),
          'data.eval_files': str(corpus / 'eval.jsonl'),
          'data.tokenizer': str(corpus / 'tokenizer.json'), 'model.vocab_size': 1024,
          'model.num_layers': 2, 'model.hidden': 32, 'model.num_heads': 2,
          'model.num_kv_heads': 1, 'model.mlp_dim': 64, 'data.seq_len': 64,
          'global_batch_size': 16, 'eval_batch_size': 16, 'eval_every_steps': 0}
  return disttrain.from_config_dict(helpers.override(cd, {**base, **overrides}))


@pytest.fixture(scope='module')
def sft_files(tmp_path_factory):
  out = tmp_path_factory.mktemp('sft')
  rng = np.random.default_rng(0)
  pairs = [{'prompt': f'Q{i}: ' + 'x' * int(rng.integers(3, 30)),
            'completion': ' A' + 'y' * int(rng.integers(1, 12))} for i in range(60)]
  chat = [{'messages': [{'role': 'system', 'content': 'be brief'},
                        {'role': 'user', 'content': f'say {i}'},
                        {'role': 'assistant', 'content': f'{i}!'}]} for i in range(4)]
  with open(out / 'train.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in pairs[:40] + chat)
  with open(out / 'eval.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in pairs[40:])
  return out


def _sft_config(files, **overrides) -> disttrain.Config:
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  base = {'data.name': 'sft', 'data.train_files': str(files / 'train.jsonl'),
          'data.eval_files': str(files / 'eval.jsonl'), 'data.tokenizer': '',
          'model.vocab_size': 260, 'model.num_layers': 2,
          'model.hidden': 32, 'model.num_heads': 2, 'model.num_kv_heads': 1,
          'model.mlp_dim': 64, 'data.seq_len': 32, 'global_batch_size': 16,
          'eval_batch_size': 16, 'eval_every_steps': 0, 'mesh.data': 2, 'mesh.fsdp': 2,
          'mesh.tensor': 2, 'grad_accum_steps': 2}
  return disttrain.from_config_dict(helpers.override(cd, {**base, **overrides}))


def _hand_loss(model, params, rows: dict) -> tuple[float, int]:
  """sum of cross-entropy over tokens whose target counts (loss_mask 1, target >= 0) / count."""
  logits = np.asarray(model.module.apply(
      {'params': params}, jnp.asarray(rows['tokens']), False,
      positions=jnp.asarray(rows['positions']), segment_ids=jnp.asarray(rows['segment_ids'])))
  targets = rows['targets']
  counted = (rows['loss_mask'] == 1) & (targets >= 0)
  ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
      jnp.asarray(logits), jnp.asarray(np.maximum(targets, 0))))
  return float((ce * counted).sum() / counted.sum()), int(counted.sum())


def test_sft_packs_whole_examples_by_default_and_the_eval_counts_every_completion_token(
    sft_files):
  """data.packing unset: sft rows hold whole examples (best fit), so train and eval count every
  completion token; concat cut pairs across rows and dropped the eval's tail."""
  cfg = _sft_config(sft_files, **{'data.packing': '', 'data.seq_len': 64})
  assert cfg.data.packed_as == 'documents'
  built = sources.build(cfg)
  for split in ('train_data', 'eval_data'):
    rows, docs = built[split], built[split].docs
    assert max(docs.lengths) - 1 <= cfg.data.seq_len  # every example fits a row
    completion = sum(int(docs.tokens(i)[1][1:].sum()) for i in range(len(docs)))
    read = [rows[r] for r in range(len(rows))]
    assert sum(int(row['loss_mask'].sum()) for row in read) == completion, split
    assert sum(int(row['segment_ids'].max()) for row in read) == len(docs), split  # none cut


@pytest.mark.slow
def test_sft_masks_prompts_and_the_loss_is_the_token_weighted_mean(sft_files):
  """8 devices (data x fsdp x tensor), 2 micro-batches, a padded eval batch: the train and eval
  losses are sum over completion tokens / their count, as computed here by hand."""
  cfg = _sft_config(sft_files)
  run = disttrain.setup(cfg, devices=devices(8))
  row = run.train_data.read(np.arange(len(run.train_data)))
  trained = row['targets'][row['loss_mask'] == 1]
  assert not np.isin(trained, [ord('x'), ord('Q'), ord(':')]).any()  # prompt characters
  assert set(trained.tolist()) >= {ord('y'), ord('A'), 256}  # completions and EOS (256)
  it = data.TrainIterator(run.train_data, cfg.global_batch_size, cfg.seed, run.batch_sharding)
  batch = next(it)
  it.close()
  params = jax.device_get(run.state.params)
  # The eval first: the train step below takes the state's buffers (no second setup needed).
  evals = run.eval_data['eval']
  assert len(evals) % cfg.eval_batch != 0  # the last eval batch is padded
  result = disttrain.evaluate(run.steps, run.state, evals, cfg.eval_batch, run.batch_sharding)
  expected, tokens = _hand_loss(run.model, params, evals.read(np.arange(len(evals))))
  np.testing.assert_allclose(result['loss'], expected, rtol=1e-5)
  assert result['num_tokens'] == tokens and result['num_examples'] == len(evals)
  np.testing.assert_allclose(result['perplexity'], np.exp(expected), rtol=1e-5)
  expected, _ = _hand_loss(run.model, params, jax.device_get(batch))
  _, metrics = run.steps.train(run.steps.place(run.state), batch)
  np.testing.assert_allclose(float(metrics['loss']), expected, rtol=1e-5)


BAD = [
    pytest.param('not_json', ['--config.data.train_files={dir}/broken.jsonl'],
                 'broken.jsonl line 2 is not JSON', marks=pytest.mark.slow),
    pytest.param('no_field', ['--config.data.text_field=body'], "line 1 has no field 'body'",
                 marks=pytest.mark.slow),
    pytest.param('no_tokenizer', ['--config.data.tokenizer={dir}/nope.json'],
                 'nope.json\' does not exist', marks=pytest.mark.slow),
    pytest.param('vocab', ['--config.model.vocab_size=512'],
                 'has 1,024 tokens but model.vocab_size=512', marks=pytest.mark.slow),
]


@pytest.mark.parametrize('case,flags,message', BAD,
                         ids=['not_json', 'no_field', 'no_tokenizer', 'vocab'])
def test_bad_text_inputs_are_one_line_and_exit_2(corpus, tmp_path, case, flags, message):
  del case
  (tmp_path / 'broken.jsonl').write_text('{"text": "fine"}\n{"text": oops}\n')
  flags = [f.replace('{dir}', str(tmp_path)) for f in flags]
  proc = subprocess.run(
      [sys.executable, 'launch/train.py', '--config=launch/configs/llama.py',
       f'--workdir={tmp_path / "run"}', '--fake_devices=8', '--config.data.name=documents',
       f'--config.data.train_files={corpus}/train.jsonl', '--config.model.vocab_size=1024',
       f'--config.data.tokenizer={corpus}/tokenizer.json', *flags],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180, check=False)
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith('error: DataError: ') and message in errors[0], errors[0]


@pytest.mark.parametrize('flags,message', [
    (['--source=text', '--format=tokens', '--eval_tokens=0'],
     '--eval_tokens=0 must be >= 1'),  # it wrote an empty train.bin and said it wrote the text
    pytest.param(['--source=text', '--format=tokens', '--tokenizer=tok.json'],  # bytes, exit 0
                 '--tokenizer applies to --source=documents, not this conversion; drop it',
                 marks=pytest.mark.slow),
    (['--source=text', '--format=tokens', '--input=mine.txt'],  # the standard library, exit 0
     '--input applies to --source=npz or documents, not this conversion; drop it'),
    (['--source=docstrings'],  # it said docstrings is not a data.name, give get_data
     '--source=docstrings --format=array_record is not a conversion; use documents -> tokens, '
     'text -> jsonl or docstrings -> jsonl'),
])
def test_bad_conversions_are_one_line_and_exit_2(tmp_path, flags, message):
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'convert', f'--out={tmp_path}',
                         *flags], cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=180, check=False)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith(f'error: DataError: {message}'), lines
  assert not list(tmp_path.iterdir())


def _launch_args(corpus, workdir, workers: int, steps: int = 12, every: int = 0,
                 train_files: str = '') -> list[str]:
  return [sys.executable, 'launch/train.py', '--config=launch/configs/llama.py',
          f'--workdir={workdir}', '--fake_devices=8', '--config.data.name=documents',
          f'--config.data.train_files={train_files or f"{corpus}/train.jsonl"}',
          f'--config.data.tokenizer={corpus}/tokenizer.json', '--config.model.vocab_size=1024',
          '--config.data.packing=documents', '--config.data.seq_len=64',
          '--config.global_batch_size=16', '--config.model.hidden=32',
          '--config.model.num_heads=2', '--config.model.num_kv_heads=1',
          '--config.model.num_layers=2', '--config.model.mlp_dim=64',
          f'--config.data.workers={workers}', f'--config.num_train_steps={steps}',
          '--config.log_every_steps=1', f'--config.checkpoint_every_steps={every}',
          '--config.eval_every_steps=0']


def _train_losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return {r['step']: r['loss'] for r in map(json.loads, f) if r['split'] == 'train'}


# A SIGKILLed run with worker processes resumes bit for bit: tests/test_workers.py (any source:
# rows are read by index, packed rows too); a language model killed and resumed through the
# launcher: tests/test_grpo.py.



"""The registry that `data.name` names, the sources read from data.train_files, and mixtures.

Every builder takes the whole Config and returns the keyword arguments of `disttrain.train`:
`{'train_data': source, 'eval_data': source or None}` -- exactly what a config file's own
`get_data(config)` returns. The built-in sets held in memory are in_memory.py's; array_record
and tokens stream from files (disttrain.data.formats), documents and sft are tokenized once and
packed (packing.py), preference pairs and GRPO prompts read from JSON lines.
"""

import dataclasses
import os
import tempfile

import jax
import numpy as np

from disttrain import moved
from disttrain.config import Config
from disttrain.data import (chat, formats, in_memory, mixture, packing, preference, prompts,
                            records, text)
from disttrain.data import tokenizer as tokenizer_lib
from disttrain.data.in_memory import eval_examples, split_tail
from disttrain.errors import DataError

# Names that moved to another module resolve there, with a DeprecationWarning.
__getattr__ = moved.names(__name__, {})


def build(cfg: Config) -> dict:
  """{'train_data', 'eval_data'} of the data set cfg.data.name names."""
  if cfg.data.name not in SOURCES:
    raise DataError(f'data.name={cfg.data.name!r} is not one of {tuple(SOURCES)}; pick one of '
                    'them, or give the data from a config file (get_data) or from Python')
  if cfg.data.mixture:
    return _mixture(cfg)
  return SOURCES[cfg.data.name](cfg)


def _mixture(cfg: Config) -> dict:
  """data.mixture: each source built by data.name's builder as if it were data.train_files
  alone; eval from data.eval_files, else each source's held-out tail named after it."""
  entries = mixture.parse_sources(cfg.data.mixture)
  names = [name for name, _, _ in entries]
  stages = mixture.parse_stages(cfg.data.mixture_stages, names) if cfg.data.mixture_stages \
      else []
  train, evals = {}, {}
  for i, (name, pattern, _) in enumerate(entries):
    eval_files = cfg.data.eval_files if i == 0 else ''  # one shared eval set, built once
    held_out = 0 if cfg.data.eval_files else cfg.data.eval_examples
    one = dataclasses.replace(cfg.data, mixture='', mixture_stages='', mixture_exhausted='repeat',
                              train_files=pattern,
                              eval_files=eval_files, eval_examples=held_out)
    try:
      built = SOURCES[cfg.data.name](dataclasses.replace(cfg, data=one))
    except DataError as e:
      raise DataError(f'data.mixture source {name!r}: {e}') from None
    train[name] = built['train_data']
    if built['eval_data'] is not None:
      evals['eval' if cfg.data.eval_files else name] = built['eval_data']
  return {'train_data': mixture.Mixture(train, {n: w for n, _, w in entries}, tuple(stages),
                                        cfg.data.mixture_exhausted),
          'eval_data': evals or None}


def _files_split(cfg: Config, open_files) -> dict:
  """Train from data.train_files; eval from data.eval_files, or the last eval_examples of train."""
  train = open_files(cfg.data.train_files, 'data.train_files')
  if cfg.data.eval_files:
    return {'train_data': train, 'eval_data': open_files(cfg.data.eval_files, 'data.eval_files')}
  held_out = eval_examples(cfg, 0)
  if held_out >= len(train):
    raise DataError(f'data.eval_examples={held_out} leaves no training data in '
                    f'data.train_files ({len(train)} examples); pass a smaller number or '
                    'data.eval_files')
  cut = len(train) - held_out
  return {'train_data': records.Slice(train, 0, cut) if held_out else train,
          'eval_data': records.Slice(train, cut, len(train)) if held_out else None}


def _array_record(cfg: Config) -> dict:
  """ArrayRecord shards of encoded feature dicts (disttrain.data.formats.write_array_record)."""
  return _files_split(cfg, lambda patterns, field: formats.array_record_source(
      formats.resolve_files(patterns, field)))


def _tokens(cfg: Config) -> dict:
  """Flat token files, windows of data.seq_len + 1 tokens (packing='concat'), or the documents
  of the converter's files packed into rows (packing='documents'); ids checked < vocab_size."""
  if cfg.data.packed_as == 'documents':
    return _packed(cfg, lambda patterns, field: packing.TokenFileDocuments(
        formats.resolve_files(patterns, field), cfg.data.tokens.dtype, cfg.model.vocab_size))
  return _files_split(cfg, lambda patterns, field: formats.TokenWindows(
      formats.resolve_files(patterns, field), cfg.data.seq_len, cfg.data.tokens.dtype,
      vocab_size=cfg.model.vocab_size))


_TOKEN_CACHE = []  # this process's temporary token files, removed when it exits


def _tokenized(cfg: Config, docs, field: str):
  """Documents tokenized once with data.tokenizer into a temporary token file of this process
  (memory-mapped by its workers, so the ids are never copied into each of them)."""
  if not _TOKEN_CACHE:
    _TOKEN_CACHE.append(tempfile.TemporaryDirectory(prefix='disttrain_tokens_'))
  # A new name per build: a second build in this process (say sft, then plain documents) must
  # not meet the first one's files (a stale .mask.bin made plain documents look like sft).
  count = len(os.listdir(_TOKEN_CACHE[0].name))
  path = os.path.join(_TOKEN_CACHE[0].name, f'{count}_{field.replace(".", "_")}.bin')
  return packing.tokenize(docs, tokenizer_lib.load(cfg.data.tokenizer), field,
                          cfg.model.vocab_size, path, verbose=jax.process_index() == 0)


def _documents(cfg: Config) -> dict:
  """Raw text documents (.txt, .jsonl, .parquet) tokenized with data.tokenizer, then packed."""
  return _packed(cfg, lambda patterns, field: _tokenized(
      cfg, text.Documents(text.resolve(patterns, field), cfg.data.text_field), field))


def _sft(cfg: Config) -> dict:
  """Prompt/completion (or chat) JSON lines with loss masks on the completions, then packed."""
  fields = cfg.data.sft
  template = chat.load(tokenizer_lib.load(cfg.data.tokenizer).file, fields.chat_template)
  return _packed(cfg, lambda patterns, field: _tokenized(cfg, text.Conversations(
      formats.resolve_files(patterns, field), fields.prompt_field, fields.completion_field,
      fields.messages_field, template), field))


def _preference(cfg: Config) -> dict:
  """Prompt/chosen/rejected JSON lines (DPO) as pairs of rows [2, data.seq_len]."""
  tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
  tokenizer.check_vocab(cfg.model.vocab_size)  # else ids beyond it: a NaN loss at step 1
  template = chat.load(tokenizer.file, cfg.data.sft.chat_template)
  read = lambda patterns, field: preference.read(
      formats.resolve_files(patterns, field), tokenizer, cfg.data.seq_len, template,
      verbose=jax.process_index() == 0)
  train = read(cfg.data.train_files, 'data.train_files')
  if cfg.data.eval_files:
    return {'train_data': train, 'eval_data': read(cfg.data.eval_files, 'data.eval_files')}
  return split_tail(train, eval_examples(cfg, 0), 'the preference pairs')


def _prompts(cfg: Config) -> dict:
  """Prompt JSON lines (GRPO) as left-padded rows of data.seq_len tokens and their line index;
  no eval split (the rollout's rewards are the measure)."""
  tokenizer_lib.load(cfg.data.tokenizer).check_vocab(cfg.model.vocab_size)  # else trained as is
  data = prompts.load(cfg.data.train_files, 'data.train_files', cfg.data.tokenizer,
                      cfg.data.seq_len, cfg.data.sft.chat_template, jax.process_index() == 0)
  return {'train_data': data.arrays, 'eval_data': None}


def _packed(cfg: Config, open_docs) -> dict:
  """Documents of data.train_files (eval: data.eval_files, or the last data.eval_examples
  documents) in rows of data.seq_len by data.packing."""
  train = open_docs(cfg.data.train_files, 'data.train_files')
  if cfg.data.eval_files:
    held_out = open_docs(cfg.data.eval_files, 'data.eval_files')
  else:
    n = eval_examples(cfg, 0)
    if n >= len(train):
      raise DataError(f'data.eval_examples={n} holds out every one of the {len(train)} documents '
                      'in data.train_files; pass fewer, or data.eval_files')
    train, held_out = (packing.DocRange(train, 0, len(train) - n),
                       packing.DocRange(train, len(train) - n, len(train)) if n else None)
  rows = packing.PackedDocuments if cfg.data.packed_as == 'documents' else packing.ConcatWindows
  out = {'train_data': rows(train, cfg.data.seq_len),
         'eval_data': rows(held_out, cfg.data.seq_len) if held_out is not None else None}
  if jax.process_index() == 0:
    for split, source in out.items():
      if source is not None:
        tokens = int(source.docs.lengths.sum())
        # A fine-tuning example longer than a row is split (its pairs past the row are trained
        # without the start): say how many, and how to keep them whole.
        long = int(np.sum(source.docs.lengths - 1 > cfg.data.seq_len)) if source.docs.sft else 0
        print(f'{split}: {len(source.docs):,} documents, {tokens:,} tokens -> {len(source):,} rows '
              f'of {cfg.data.seq_len} ({cfg.data.packed_as}; {100 * source.padding_fraction:.1f}% '
              'padding)' + (f'; {long:,} examples longer than a row are split, raise '
                            'data.seq_len to keep them whole' if long else ''), flush=True)
  return out


# data.name -> builder(config) -> {'train_data', 'eval_data'}; the first five are in memory
# (in_memory.py). A plain dict: a config names its data on the command line; anything else
# comes from a config file's get_data or from Python.
SOURCES = {
    'digits': in_memory.build_digits,  # scikit-learn's 1,797 real 8x8 digits
    'mnist': in_memory.build_mnist,  # IDX files in data.dir
    'synthetic': in_memory.build_synthetic,  # Gaussian features, linear teacher (benchmarks)
    'synthetic_tokens': in_memory.build_synthetic_tokens,  # random token rows (benchmarks)
    'text': in_memory.build_text,  # byte windows of text files
    'array_record': _array_record,  # ArrayRecord shards in data.train_files / eval_files
    'tokens': _tokens,  # flat token files in data.train_files / eval_files
    'documents': _documents,  # raw text files, tokenized and packed
    'sft': _sft,  # prompt/completion or chat JSON lines with loss masks, tokenized and packed
    'preference': _preference,  # prompt/chosen/rejected JSON lines as [2, T] pairs (DPO)
    'prompts': _prompts,  # prompt JSON lines, left-padded, with the fields rewards read (GRPO)
}

r"""Write a data set to disttrain's on-disk formats: ArrayRecord shards, token files, JSON lines.

  disttrain convert --source=mnist --data_dir=../shared/data/mnist --out=data/mnist
  disttrain convert --source=npz --input=my.npz --eval_examples=1000 --out=data/mine
  disttrain convert --source=text --format=tokens --out=data/text
  disttrain convert --source=documents --input='corpus/*.jsonl' \
      --tokenizer=tok/tokenizer.json --format=tokens --eval_documents=100 --out=data/corpus
  disttrain convert --source=text --format=jsonl --out=data/docs
  disttrain convert --source=docstrings --format=jsonl --out=data/sft

--source: a built-in set (digits, mnist, synthetic, text: split as data.name would split it),
npz (every array of --input is a field; the first dimension counts examples), documents (raw text
files --input, .txt/.jsonl/.parquet), docstrings (prompt/completion pairs from the standard
library: a function's signature -> the first line of its docstring). --format: array_record
(OUT/train-0000i-of-0000N.array_record, OUT/eval-...); tokens (text: OUT/train.bin and
OUT/eval.bin of byte ids, the last --eval_tokens for eval; documents: ids of --tokenizer, each
document ended by EOS, with OUT/*.bin.docs.npy indexes for data.packing='documents'); jsonl
(text: one {"text"} document per file; docstrings: {"prompt", "completion"}; the last
--eval_documents for eval). The last line printed is the flags that train on what was written.
"""

import ast
import glob
import json
import os

from absl import flags
import numpy as np

from disttrain import commandline
from disttrain.errors import DataError

_SOURCE = flags.DEFINE_enum('source', None, ['digits', 'mnist', 'synthetic', 'text', 'npz',
                                              'documents', 'docstrings'], 'What to convert.')
_OUT = flags.DEFINE_string('out', None, 'Output folder.')
_FORMAT = flags.DEFINE_enum('format', 'array_record', ['array_record', 'tokens', 'jsonl'],
                            'array_record (arrays), tokens (text, documents) or jsonl (text, '
                            'docstrings).')
_TOKENIZER = flags.DEFINE_string('tokenizer', '', "documents: tokenizer file ('' = bytes).")
_TEXT_FIELD = flags.DEFINE_string('text_field', 'text', 'documents: JSONL field / Parquet column.')
_EVAL_DOCUMENTS = flags.DEFINE_integer('eval_documents', 0, 'documents, jsonl: the last N '
                                       'documents (or pairs) go to eval.')
_SHARDS = flags.DEFINE_integer('shards', 4, 'ArrayRecord files per split.')
_DATA_DIR = flags.DEFINE_string('data_dir', '', 'mnist: IDX folder; text: a folder of text '
                                '(default: the standard library).')
_INPUT = flags.DEFINE_string('input', '', 'npz: the .npz file; documents: text file globs.')
_EVAL_EXAMPLES = flags.DEFINE_integer('eval_examples', -1, 'Examples held out for eval (the '
                                      "last ones); -1 = the built-in set's default, 0 for npz.")
_TEXT_BYTES = flags.DEFINE_integer('text_bytes', 2**21, 'text: bytes read.')
_EVAL_TOKENS = flags.DEFINE_integer('eval_tokens', 2**15 + 1, 'tokens: ids written to eval.bin.')
_TOKEN_DTYPE = flags.DEFINE_enum('token_dtype', 'uint16', ['uint16', 'uint32'],
                                 'tokens: id type.')
flags.mark_flags_as_required(['source', 'out'])
# The built-in sets name the config's fields in their fixes (the documents reader: main).
_AS_FLAGS = {'--config.data.dir=': '--data_dir=',
             '--config.data.eval_examples=': '--eval_examples='}


def _builtin(name: str) -> dict:
  """{'train_data', 'eval_data'} of a built-in set, as data.name would load it."""
  from disttrain import config as config_lib  # pylint: disable=g-import-not-at-top
  from disttrain.data import sources
  cd = config_lib.defaults()
  cd.data.name, cd.data.dir, cd.data.eval_examples = name, _DATA_DIR.value, _EVAL_EXAMPLES.value
  cd.data.text.bytes = _TEXT_BYTES.value
  return sources.build(config_lib.from_config_dict(cd))


def _npz() -> dict:
  """The arrays of --input as one in-memory source, the last --eval_examples held out."""
  try:
    with np.load(_INPUT.value, allow_pickle=False) as f:
      arrays = {k: f[k] for k in f.files}
  except (OSError, ValueError) as e:
    raise DataError(f'--input={_INPUT.value!r} cannot be read as .npz ({e}); pass an .npz file '
                    'of arrays with one leading example dimension') from e
  sizes = {len(v) if v.ndim else 0 for v in arrays.values()}
  if len(sizes) != 1 or 0 in sizes:
    raise DataError(f'--input={_INPUT.value!r}: arrays {sorted(arrays)} do not share one leading '
                    'example dimension; save one array per field, all with N rows')
  held_out = max(_EVAL_EXAMPLES.value, 0)
  cut = sizes.pop() - held_out
  if cut <= 0:
    raise DataError(f'--eval_examples={held_out} leaves no training examples; pass fewer')
  return {'train_data': {k: v[:cut] for k, v in arrays.items()},
          'eval_data': {k: v[cut:] for k, v in arrays.items()} if held_out else None}


# An earlier conversion's files in --out, by format: a split, shard or side file not written
# again would be read beside the new ones (the printed shard glob, an eval split, a loss mask).
_EARLIER = {'tokens': [f'{split}.bin{side}{partial}' for split in ('train', 'eval')
                       for side in ('', '.docs.npy', '.mask.bin') for partial in ('', '.partial')],
            'array_record': ['train-*-of-*.array_record', 'eval-*-of-*.array_record'],
            'jsonl': ['train.jsonl', 'eval.jsonl']}


def _clear_earlier(out: str, form: str) -> None:
  stale = sorted({path for pattern in _EARLIER[form]
                  for path in glob.glob(os.path.join(glob.escape(out), pattern))})
  for path in stale:
    os.remove(path)
  if stale:
    print(f'removed {len(stale)} {form} file(s) of an earlier conversion in {out}')


def _documents(out: str) -> str:
  """--source=documents --format=tokens: every document tokenized once into token files."""
  # pylint: disable-next=g-import-not-at-top
  from disttrain.data import packing, text, tokenizer as tokenizer_lib
  docs = text.Documents(text.resolve(_INPUT.value, '--input'), _TEXT_FIELD.value)
  tok = tokenizer_lib.load(_TOKENIZER.value)
  held_out = _EVAL_DOCUMENTS.value
  if not 0 <= held_out < len(docs):
    raise DataError(f'--eval_documents={held_out} must be in 0..{len(docs) - 1} (the input has '
                    f'{len(docs)} documents)')
  os.makedirs(out, exist_ok=True)
  _clear_earlier(out, 'tokens')
  written = []
  from disttrain.data.records import Slice  # pylint: disable=g-import-not-at-top
  for split, part in (('train', Slice(docs, 0, len(docs) - held_out)),
                      ('eval', Slice(docs, len(docs) - held_out, len(docs)))):
    if len(part):
      path = os.path.join(out, f'{split}.bin')
      result = packing.tokenize(part, tok, split, tok.vocab_size, path)
      print(f'wrote {len(result):,} {split} documents, {int(result.lengths.sum()):,} tokens '
            f'({result.dtype.name}) to {path} (+ .docs.npy)')
      written.append(path)
  line = (f'--config.data.name=tokens --config.data.packing=documents '
          f'--config.data.train_files={written[0]} --config.data.tokens.dtype='
          f'{"uint16" if tok.vocab_size <= 2**16 else "uint32"} --config.model.vocab_size='
          f'{tok.vocab_size}')
  return line + (f' --config.data.eval_files={written[1]}' if len(written) > 1 else '')


def _jsonl(out: str) -> str:
  """--format=jsonl: text files as {"text"} documents, or docstring prompt/completion pairs."""
  from disttrain.data import in_memory  # pylint: disable=g-import-not-at-top
  files = in_memory.text_files(_DATA_DIR.value)
  records = [{'text': _read(path)} for path in files] if _SOURCE.value == 'text' else [
      pair for path in files for pair in _docstring_pairs(path)]
  held_out = _EVAL_DOCUMENTS.value
  if not 0 <= held_out < len(records):
    raise DataError(f'--eval_documents={held_out} must be in 0..{len(records) - 1}')
  _clear_earlier(out, 'jsonl')
  os.makedirs(out, exist_ok=True)
  paths = []
  for split, part in (('train', records[:len(records) - held_out]),
                      ('eval', records[len(records) - held_out:])):
    if part:
      paths.append(os.path.join(out, f'{split}.jsonl'))
      with open(paths[-1], 'w', encoding='utf-8') as f:
        f.writelines(json.dumps(r) + '\n' for r in part)
      print(f'wrote {len(part):,} {split} records to {paths[-1]}')
  name = 'documents' if _SOURCE.value == 'text' else 'sft'
  line = f'--config.data.name={name} --config.data.train_files={paths[0]}'
  return line + (f' --config.data.eval_files={paths[1]}' if len(paths) > 1 else '')


def _read(path: str) -> str:
  with open(path, encoding='utf-8', errors='replace') as f:
    return f.read()


def _docstring_pairs(path: str) -> list[dict]:
  """{'prompt': 'def name(args):\n    \"\"\"', 'completion': first docstring line + '\"\"\"'}
  for each documented function of a Python file."""
  try:
    tree = ast.parse(_read(path))
  except SyntaxError:
    return []
  pairs = []
  for node in ast.walk(tree):
    doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
    line = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ''
    if line and len(line) < 200:
      pairs.append({'prompt': f'def {node.name}({ast.unparse(node.args)}):\n    """',
                    'completion': f'{line}"""'})
  return pairs


# Flags only some conversions read, and the conversions that read them.
_ONLY = {'tokenizer': '--source=documents', 'text_field': '--source=documents',
         'eval_documents': '--source=documents and --format=jsonl',
         'eval_tokens': '--source=text --format=tokens',
         'token_dtype': '--source=text --format=tokens',
         'eval_examples': '--format=array_record (documents: --eval_documents)',
         'input': '--source=npz or documents', 'data_dir': '--source=mnist, text or docstrings',
         'shards': '--format=array_record', 'text_bytes': '--source=text (not --format=jsonl)'}


def _unused_flag() -> str | None:
  """The first flag given that this conversion does not read (it was ignored, exit 0)."""
  source, form = _SOURCE.value, _FORMAT.value
  reads = {'tokenizer': source == 'documents', 'text_field': source == 'documents',
           'eval_documents': source == 'documents' or form == 'jsonl',
           'eval_tokens': (source, form) == ('text', 'tokens'),
           'token_dtype': (source, form) == ('text', 'tokens'),
           'eval_examples': form == 'array_record' and source != 'documents',
           'input': source in ('npz', 'documents'),
           'data_dir': source in ('mnist', 'text', 'docstrings'),
           'shards': form == 'array_record', 'text_bytes': source == 'text' and form != 'jsonl'}
  for name, where in _ONLY.items():
    if flags.FLAGS[name].present and not reads[name]:
      return f'--{name} applies to {where}, not this conversion; drop it'
  return None


def convert() -> str:
  """Writes the files; returns the flags that train on them."""
  from disttrain.data import formats, in_memory  # pylint: disable=g-import-not-at-top
  out = _OUT.value
  commandline.output_dir('out', out)
  unused = _unused_flag()
  if unused:
    raise DataError(unused)
  if _SOURCE.value in ('documents', 'docstrings') or _FORMAT.value == 'jsonl':
    if (_SOURCE.value, _FORMAT.value) not in (('documents', 'tokens'), ('text', 'jsonl'),
                                              ('docstrings', 'jsonl')):
      raise DataError(f'--source={_SOURCE.value} --format={_FORMAT.value} is not a conversion; '
                      'use documents -> tokens, text -> jsonl or docstrings -> jsonl')
    return _documents(out) if _SOURCE.value == 'documents' else _jsonl(out)
  if _FORMAT.value == 'tokens':
    if _SOURCE.value != 'text':
      raise DataError(f'--format=tokens writes token ids of text, not --source={_SOURCE.value}; '
                      'use --format=array_record')
    if _EVAL_TOKENS.value < 1:  # ids[:-0] would be an empty train.bin
      raise DataError(f'--eval_tokens={_EVAL_TOKENS.value} must be >= 1 (eval.bin is the held-out '
                      'tail); pass a count')
    ids = in_memory.text_bytes(_DATA_DIR.value, _TEXT_BYTES.value)
    if len(ids) <= 2 * _EVAL_TOKENS.value:
      raise DataError(f'the text has {len(ids)} bytes, not more than twice --eval_tokens='
                      f'{_EVAL_TOKENS.value}; read more (--text_bytes) or hold out fewer')
    _clear_earlier(out, 'tokens')
    train = formats.write_tokens(os.path.join(out, 'train.bin'), ids[:-_EVAL_TOKENS.value],
                                 _TOKEN_DTYPE.value)
    held_out = formats.write_tokens(os.path.join(out, 'eval.bin'), ids[-_EVAL_TOKENS.value:],
                                    _TOKEN_DTYPE.value)
    print(f'wrote {len(ids) - _EVAL_TOKENS.value:,} train and {_EVAL_TOKENS.value:,} eval token '
          f'ids ({_TOKEN_DTYPE.value}) to {train} and {held_out}')
    return (f'--config.data.name=tokens --config.data.train_files={train} '
            f'--config.data.eval_files={held_out} --config.data.tokens.dtype={_TOKEN_DTYPE.value}')
  data = _npz() if _SOURCE.value == 'npz' else _builtin(_SOURCE.value)
  _clear_earlier(out, 'array_record')
  written = {}
  for split, key in (('train', 'train_data'), ('eval', 'eval_data')):
    if data[key] is None:
      continue
    paths = formats.write_array_record(os.path.join(out, split), data[key], _SHARDS.value)
    count = len(next(iter(data[key].values())))
    print(f'wrote {count:,} {split} examples to {len(paths)} files {paths[0]} ...')
    written[split] = os.path.join(out, f'{split}-*{formats.ARRAY_RECORD_SUFFIX}')
  flags_line = f"--config.data.name=array_record --config.data.train_files='{written['train']}'"
  if 'eval' in written:
    flags_line += f" --config.data.eval_files='{written['eval']}'"
  return flags_line


def main(argv):
  if len(argv) > 1:
    commandline.fail(f'unexpected arguments {argv[1:]}; pass settings as flags, e.g. '
                     '--source=mnist')
  if _SOURCE.value in ('npz', 'documents') and not _INPUT.value:
    commandline.fail(f'--source={_SOURCE.value} needs --input=FILE')
  if _SHARDS.value < 1:
    commandline.fail(f'--shards={_SHARDS.value} must be >= 1')
  from disttrain.errors import DisttrainError  # pylint: disable=g-import-not-at-top
  try:
    print(f'train with: {convert()}')
  except DisttrainError as e:
    from disttrain.data import text  # pylint: disable=g-import-not-at-top
    spellings = {**_AS_FLAGS, text.FIELD_SETTINGS: '--text_field'}
    commandline.fail(f'{type(e).__name__}: ' + commandline.in_flags(str(e), spellings))



if __name__ == '__main__':
  commandline.run(main)

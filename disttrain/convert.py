"""Write a data set to disttrain's on-disk formats: ArrayRecord shards or flat token files.

  python -m disttrain.convert --source=mnist --data_dir=../shared/data/mnist --out=data/mnist
  python -m disttrain.convert --source=npz --input=my.npz --eval_examples=1000 --out=data/mine
  python -m disttrain.convert --source=text --format=tokens --out=data/text

--source: a built-in set (digits, mnist, synthetic, text: split as data.name would split it) or
npz (every array of --input is a field; the first dimension counts examples). --format:
array_record (OUT/train-0000i-of-0000N.array_record, OUT/eval-...), or tokens (text only:
OUT/train.bin and OUT/eval.bin, raw uint16 token ids, the last --eval_tokens ids for eval).
The last line printed is the flags that train on what was written.
"""

import os
import sys

from absl import app, flags
import numpy as np

_SOURCE = flags.DEFINE_enum('source', None, ['digits', 'mnist', 'synthetic', 'text', 'npz'],
                            'What to convert.')
_OUT = flags.DEFINE_string('out', None, 'Output folder.')
_FORMAT = flags.DEFINE_enum('format', 'array_record', ['array_record', 'tokens'],
                            'array_record (any source) or tokens (text).')
_SHARDS = flags.DEFINE_integer('shards', 4, 'ArrayRecord files per split.')
_DATA_DIR = flags.DEFINE_string('data_dir', '', 'mnist: IDX folder; text: a folder of text '
                                '(default: the standard library).')
_INPUT = flags.DEFINE_string('input', '', 'npz: the .npz file.')
_EVAL_EXAMPLES = flags.DEFINE_integer('eval_examples', -1, 'Examples held out for eval (the '
                                      "last ones); -1 = the built-in set's default, 0 for npz.")
_TEXT_BYTES = flags.DEFINE_integer('text_bytes', 2**21, 'text: bytes read.')
_EVAL_TOKENS = flags.DEFINE_integer('eval_tokens', 2**15 + 1, 'tokens: ids written to eval.bin.')
_TOKEN_DTYPE = flags.DEFINE_enum('token_dtype', 'uint16', ['uint16', 'uint32'],
                                 'tokens: id type.')
flags.mark_flags_as_required(['source', 'out'])


def _builtin(name: str) -> dict:
  """{'train_data', 'eval_data'} of a built-in set, as data.name would load it."""
  from disttrain import config as config_lib, sources  # pylint: disable=g-import-not-at-top
  cd = config_lib.defaults()
  cd.data.name, cd.data.dir, cd.data.eval_examples = name, _DATA_DIR.value, _EVAL_EXAMPLES.value
  cd.data.text.bytes = _TEXT_BYTES.value
  return sources.build(config_lib.from_config_dict(cd))


def _npz() -> dict:
  """The arrays of --input as one in-memory source, the last --eval_examples held out."""
  from disttrain.errors import DataError  # pylint: disable=g-import-not-at-top
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


def convert() -> str:
  """Writes the files; returns the flags that train on them."""
  from disttrain import formats, sources  # pylint: disable=g-import-not-at-top
  from disttrain.errors import DataError  # pylint: disable=g-import-not-at-top
  out = _OUT.value
  if _FORMAT.value == 'tokens':
    if _SOURCE.value != 'text':
      raise DataError(f'--format=tokens writes token ids of text, not --source={_SOURCE.value}; '
                      'use --format=array_record')
    ids = sources.text_bytes(_DATA_DIR.value, _TEXT_BYTES.value)
    if len(ids) <= 2 * _EVAL_TOKENS.value:
      raise DataError(f'the text has {len(ids)} bytes, not more than twice --eval_tokens='
                      f'{_EVAL_TOKENS.value}; read more (--text_bytes) or hold out fewer')
    train = formats.write_tokens(os.path.join(out, 'train.bin'), ids[:-_EVAL_TOKENS.value],
                                 _TOKEN_DTYPE.value)
    held_out = formats.write_tokens(os.path.join(out, 'eval.bin'), ids[-_EVAL_TOKENS.value:],
                                    _TOKEN_DTYPE.value)
    print(f'wrote {len(ids) - _EVAL_TOKENS.value:,} train and {_EVAL_TOKENS.value:,} eval token '
          f'ids ({_TOKEN_DTYPE.value}) to {train} and {held_out}')
    return (f'--config.data.name=tokens --config.data.train_files={train} '
            f'--config.data.eval_files={held_out} --config.data.tokens.dtype={_TOKEN_DTYPE.value}')
  data = _npz() if _SOURCE.value == 'npz' else _builtin(_SOURCE.value)
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
    _fail(f'unexpected arguments {argv[1:]}; pass settings as flags, e.g. --source=mnist')
  if _SOURCE.value == 'npz' and not _INPUT.value:
    _fail('--source=npz needs --input=FILE.npz')
  if _SHARDS.value < 1:
    _fail(f'--shards={_SHARDS.value} must be >= 1')
  from disttrain.errors import DisttrainError  # pylint: disable=g-import-not-at-top
  try:
    print(f'train with: {convert()}')
  except DisttrainError as e:
    _fail(f'{type(e).__name__}: {e}')


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(2)


def _parse(argv: list[str]) -> list[str]:
  """absl's parsing with one-line errors (exit 2)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(f'{e}; run with --helpfull to list the flags')


if __name__ == '__main__':
  app.run(main, flags_parser=_parse)

"""On-disk example formats, streamed and never loaded whole.

- ArrayRecord shards (grain's own random-access format) of serialized feature dicts: one record
  per example, msgpack-encoded numpy arrays (dtype and shape kept, 0-d arrays included). Write
  with `write_array_record`, read with `array_record_source(pattern)`: grain's
  ArrayRecordDataSource (whose read failures name the damaged file and record) mapped by `decode`.
- Flat token files (nanoGPT's `.bin`: raw uint16 or uint32 token ids, no header), memory-mapped
  and read as windows of seq_len + 1 tokens by `TokenWindows`.
"""

import glob
import json
import os
import re
from collections.abc import Iterable, Sequence

import grain
import numpy as np
from flax import serialization

from disttrain.errors import DataError, first_line

ARRAY_RECORD_SUFFIX = '.array_record'


def encode(example: dict) -> bytes:
  """One feature dict as bytes (msgpack of numpy arrays)."""
  return serialization.msgpack_serialize({k: np.asarray(v) for k, v in example.items()})


def decode(record: bytes) -> dict[str, np.ndarray]:
  """The feature dict of one encoded record."""
  return {k: np.asarray(v) for k, v in serialization.msgpack_restore(record).items()}


def shard_paths(prefix: str, num_shards: int) -> list[str]:
  """PREFIX-00000-of-0000N.array_record, ...: sorted order is example order."""
  return [f'{prefix}-{i:05d}-of-{num_shards:05d}{ARRAY_RECORD_SUFFIX}' for i in range(num_shards)]


def write_array_record(prefix: str, examples: Iterable[dict], num_shards: int = 1,
                       num_examples: int | None = None,
                       options: str = 'group_size:1') -> list[str]:
  """Writes feature dicts to `num_shards` ArrayRecord files; returns their paths.

  Shard i holds a contiguous block of examples, so reading the sorted paths back (one
  ArrayRecordDataSource over all of them) gives the examples in the order written. Records are
  written with group_size 1, which random access (a shuffled read per example) needs.

  Args:
    prefix: path prefix, e.g. 'data/train' -> data/train-00000-of-00004.array_record.
    examples: feature dicts; anything `disttrain.data.records.examples` iterates (a source with
      `__len__`/`__getitem__`, a dict of arrays, or an iterable of dicts).
    num_shards: files to spread the examples over; > 1 needs the number of examples.
    num_examples: the number of examples when `examples` has no len().
    options: ArrayRecordWriter options; group_size must stay 1 (random access). The default
      compresses with zstd; add ',uncompressed' for data that does not compress (pixels).
  """
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  from disttrain.data import records  # pylint: disable=g-import-not-at-top  (it loads jax)
  if num_examples is None:
    num_examples = records.num_examples(examples)
  if num_shards < 1 or (num_shards > 1 and not num_examples):
    raise DataError(f'num_shards={num_shards} needs num_shards >= 1 and, above 1, a known number '
                    'of examples; pass num_examples= or a source with len()')
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  paths = shard_paths(prefix, num_shards)
  per_shard = -(-num_examples // num_shards) if num_shards > 1 else None
  shard, writer, written = -1, None, 0
  try:
    for i, example in enumerate(records.examples(examples)):
      if writer is None or (per_shard and i // per_shard != shard):
        if writer is not None:
          writer.close()
        shard += 1
        if shard == num_shards:
          raise DataError(f'write_array_record({prefix!r}): num_examples={num_examples} but '
                          f'the source gave more; pass its true count')
        writer = ArrayRecordWriter(paths[shard], options)
      writer.write(encode(example))
      written += 1
  finally:
    if writer is not None:
      writer.close()
  for path in paths[shard + 1:]:  # fewer examples than shards: the rest are empty files
    ArrayRecordWriter(path, options).close()
  if not written:
    raise DataError(f'write_array_record({prefix!r}): no examples to write; pass a non-empty '
                    'source')
  return paths


def resolve_files(patterns: str, field: str) -> list[str]:
  """Sorted files of comma-separated globs, each file once where globs overlap (a union, as
  'a.jsonl,a*.jsonl' means); each glob must match at least one file, and no directory."""
  paths, seen = [], set()
  for pattern in (p.strip() for p in patterns.split(',') if p.strip()):
    matched = sorted(glob.glob(os.path.expanduser(pattern)))
    if not matched:
      raise DataError(f'{field}={pattern!r} matches no file; pass a glob of existing files (e.g. '
                      'data/train-*.array_record, written by disttrain convert)')
    paths += [p for p in matched if p not in seen]
    seen.update(matched)
  if not paths:
    raise DataError(f'{field} is empty; pass a glob of the data files')
  folders = [p for p in paths if os.path.isdir(p)]
  if folders:
    raise DataError(f'{field}: {folders[0]} is a directory; pass files (a glob such as '
                    f'{os.path.join(folders[0], "*")})')
  return paths


def json_lines(paths: Sequence[str], what: str) -> Iterable[tuple[str, object]]:
  """(where, parsed value) of every non-blank line of JSON-lines files; `what` says in the error
  what the files should hold. A file not named .jsonl/.json or a line that is not JSON is one
  line naming the file (and the line)."""
  for path in paths:
    if not path.endswith(('.jsonl', '.json')):
      raise DataError(f'{path}: {what}')
    with open(path, 'rb') as f:  # bytes: a line that is not UTF-8 is named like a bad one
      for number, raw in enumerate(f, 1):
        if raw.strip():
          where = f'{path} line {number}'
          yield where, json_line(raw, where)


# A high surrogate escape with no low one after it, or a low one with no high one before it.
_SURROGATE_ESCAPE = re.compile(rb'\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])'
                               rb'|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]')


_JSON_LINES = ("these files are JSON lines, one object per line: convert it with "
               "jq -c '.[]' FILE > FILE.jsonl")


def json_line(raw: bytes, where: str) -> object:
  """One JSON line's value, or one line naming it: not UTF-8, not JSON, an array (a .json file of
  one array, not JSON lines), or holding a lone surrogate escape ("\\ud83d" without its pair:
  JSON reads it, no tokenizer can encode it).
  A BOM before it is dropped, as editors on Windows save the first line."""
  try:
    line = raw.decode('utf-8-sig')
  except UnicodeDecodeError as e:
    raise DataError(f'{where} is not UTF-8 ({e.reason} at byte {e.start}); re-encode the file '
                    'as UTF-8') from None
  try:
    value = json.loads(line)
  except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
    if line.lstrip().startswith('['):  # a .json file of one array (Alpaca's), pretty-printed
      raise DataError(f'{where} opens a JSON array; {_JSON_LINES}') from None
    raise DataError(f'{where} is not JSON ({getattr(e, "msg", e)}); fix or remove that '
                    'line') from None
  if isinstance(value, list):
    raise DataError(f'{where} is a JSON array; {_JSON_LINES}')
  if _SURROGATE_ESCAPE.search(raw):  # rare (paired escapes pass): then the second pass
    try:
      json.dumps(value, ensure_ascii=False).encode('utf-8')
    except UnicodeEncodeError:
      raise DataError(f'{where} holds a lone UTF-16 surrogate escape (such as "\\ud83d" '
                      'without its pair), which is no text; replace it (e.g. with "\\ufffd") '
                      'or remove that line') from None
  return value


def array_record_source(paths: str | Sequence[str]) -> grain.MapDataset:
  """A random-access source of the feature dicts in ArrayRecord files (globs allowed)."""
  if isinstance(paths, str):
    paths = resolve_files(paths, 'paths')
  return grain.MapDataset.source(ArrayRecordFiles(list(paths))).map(decode)


def _damaged(path: str, where: str, error: Exception) -> DataError:
  return DataError(f'{path}: {where} cannot be read ({first_line(error, 200)}): the file is '
                   'truncated or damaged; write it again (disttrain convert) or leave '
                   'it out of the data files')


class ArrayRecordFiles(grain.sources.ArrayRecordDataSource):
  """grain's ArrayRecord source whose read failures name the file and the record (DataError).

  Riegeli's own error says neither which shard is damaged nor which record; a truncated shard
  fails when its footer is read (here, at start-up), flipped bytes when their chunk is read.
  """

  def __init__(self, paths: Sequence[str]):
    try:
      super().__init__(list(paths))
    except Exception as e:  # pylint: disable=broad-except
      for path in paths:  # which one: each alone
        try:
          grain.sources.ArrayRecordDataSource([path])
        except Exception as alone:  # pylint: disable=broad-except
          raise _damaged(path, 'its index', alone) from None
      raise DataError(f'ArrayRecord files {list(paths)[:3]}... cannot be opened '
                      f'({first_line(e, 200)})') from None

  def _locate(self, key: int) -> tuple[str, int]:
    """(file, record within it) of a global record key."""
    reader, position = self._reader_idx_and_position(key)
    return self._read_instructions[reader].filename, position

  def __getitem__(self, key):
    try:
      return super().__getitem__(key)
    except Exception as e:  # pylint: disable=broad-except
      path, position = self._locate(key)
      raise _damaged(path, f'record {position}', e) from None

  def __getitems__(self, keys):
    try:
      return super().__getitems__(keys)
    except Exception:  # pylint: disable=broad-except
      for key in keys:  # the first record that fails alone is the one to name
        self[key]
      raise


def token_count(path: str, dtype: np.dtype) -> int:
  """Tokens in a flat token file of `dtype`, checked to be one: its size and, for uint16, that it
  is not a uint32 file (whose ids would read as halves that all pass the vocabulary check)."""
  size = os.path.getsize(path)
  if size % dtype.itemsize:
    raise DataError(f'{path} has {size} bytes, not a multiple of the {dtype.itemsize}-byte '
                    f'{dtype.name} token size; it is truncated or not a {dtype.name} token file '
                    '(check data.tokens.dtype)')
  count = size // dtype.itemsize
  if dtype == np.uint16 and count >= 256 and not size % 4:
    head = np.fromfile(path, np.uint16, count=min(count, 1 << 16))
    # A uint32 id below 2^18 has a high half of 0-3: real uint16 text never has that at every
    # odd position.
    if head[1::2].max() <= 3 < head[0::2].max():
      raise DataError(f'{path} reads as a uint32 token file (every second uint16 is 0-3, the '
                      'high half of a 32-bit id); set --config.data.tokens.dtype=uint32')
  return count


class TokenWindows:
  """Windows of flat token files: example k = {'tokens': ids[kL:kL+L], 'targets': the next ids}.

  Several files are read one after the other (windows never straddle two files). The files are
  memory-mapped on first read (also in each worker process: only paths are pickled). With
  `vocab_size`, every window read is checked: a token id >= vocab_size is a DataError naming the
  file and position (embedding lookups would silently clamp it).
  """

  def __init__(self, paths: str | Sequence[str], seq_len: int, dtype: str = 'uint16',
               vocab_size: int | None = None):
    self.paths = resolve_files(paths, 'data.train_files') if isinstance(paths, str) else list(paths)
    self.seq_len, self.dtype, self.vocab_size = seq_len, np.dtype(dtype), vocab_size
    counts = []
    for path in self.paths:
      counts.append(max(token_count(path, self.dtype) - 1, 0) // seq_len)
    self._ends = np.cumsum(counts)
    self._maps: list[np.ndarray] | None = None

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < len(self):
      raise IndexError(f'window {index} out of range 0..{len(self) - 1}')
    if self._maps is None:
      self._maps = [np.memmap(p, self.dtype, mode='r') for p in self.paths]
    f = int(np.searchsorted(self._ends, index, side='right'))
    start = (index - (int(self._ends[f - 1]) if f else 0)) * self.seq_len
    window = np.asarray(self._maps[f][start:start + self.seq_len + 1], np.int32)
    if self.vocab_size is not None and window.max(initial=0) >= self.vocab_size:
      at = int(np.argmax(window >= self.vocab_size))
      raise DataError(f'{self.paths[f]}: token id {int(window[at])} at token {start + at} is >= '
                      f'model.vocab_size={self.vocab_size}; raise model.vocab_size or check the '
                      'token file (data.tokens.dtype)')
    return {'tokens': window[:-1], 'targets': window[1:]}

  def __getstate__(self) -> dict:
    return {**self.__dict__, '_maps': None}  # workers map the files themselves


def write_tokens(path: str, tokens: np.ndarray, dtype: str = 'uint16') -> str:
  """A flat token file of `tokens` (1-D ids) in `dtype`; refuses ids that do not fit."""
  dtype = np.dtype(dtype)
  tokens = np.asarray(tokens)
  if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
    raise DataError(f'token ids {int(tokens.min())}..{int(tokens.max())} do not fit {dtype.name}; '
                    'use uint32')
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tokens.astype(dtype).tofile(path)
  return path

"""Token documents -> fixed-length training rows, as random-access sources of feature dicts.

  tokenize(docs, tokenizer, ..., path)  raw documents (or SFT pieces) tokenized once, with
                                        progress, into a token file + document index
  TokenFileDocuments(paths)             the documents of such files (memory-mapped: every worker
                                        and process shares the pages)
  ConcatWindows(docs, seq_len)          packing='concat': the documents joined (each ends with
                                        EOS) and cut into windows {'tokens', 'targets'}
  PackedDocuments(docs, seq_len)        packing='documents': whole documents in rows by best fit
                                        decreasing, {'tokens', 'targets', 'segment_ids',
                                        'positions'}; a document longer than a row is split

A document of n tokens gives n - 1 (input, target) pairs, so no target crosses into the next
document. In packed rows `segment_ids` number the pieces 1, 2, ... (0 = padding, whose targets are
-1) and `positions` restart at 0 for each piece. SFT documents add `loss_mask` (1 where the target
is a completion token), aligned with the targets. Everything is a pure function of the documents
and seq_len: rows are the same on every process, in every worker, after every resume.
"""

import bisect
import os
import sys
import time

import numpy as np

from disttrain.data import formats
from disttrain.errors import DataError

_ENCODE_BATCH = 512  # documents per tokenizer call (tokenizers encodes a batch on every core)


_PARTIAL = '.partial'


def tokenize(docs, tokenizer, name: str, vocab_size: int, path: str,
             verbose: bool = True) -> 'TokenFileDocuments':
  """Tokenizes every document once, into a token file and its document index, and opens them.

  `docs[i]` is a string (disttrain.data.text.Documents) or, for supervised fine-tuning, a list of
  (text, trained) pieces (disttrain.data.text.Conversations), whose loss mask (1 on trained pieces'
  tokens and on the final EOS) goes to PATH.mask.bin. Each document ends with EOS, except a
  conversation rendered by a chat template (chat.Rendered), which ends with the template's own
  end-of-turn token (Tokenizer.encode_pieces). Ids are uint16
  when the vocabulary allows, else uint32. Prints progress with rate and ETA on long corpora.
  """
  tokenizer.check_vocab(vocab_size)
  if tokenizer.eos_id is None:
    raise DataError(f'data.tokenizer={tokenizer.path!r} has no end-of-sequence token (none '
                    'named in tokenizer_config.json, none of the usual names); documents need one '
                    'to be joined or packed')
  dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
  sft = len(docs) > 0 and not isinstance(docs[0], str)
  starts, at = np.zeros(len(docs), np.int64), 0
  start = last = time.monotonic()
  # Renamed into place when whole (the .bin last): a stopped conversion leaves no corpus to read.
  sides = ('.mask.bin', '.docs.npy', '') if sft else ('.docs.npy', '')
  try:
    with (open(path + _PARTIAL, 'wb') as ids_file,
          open(path + '.mask.bin' + _PARTIAL, 'wb') if sft else _Null() as masks):
      for lo in range(0, len(docs), _ENCODE_BATCH):
        hi = min(lo + _ENCODE_BATCH, len(docs))
        for i, (ids, mask) in zip(range(lo, hi), _encode(docs, lo, hi, tokenizer, sft)):
          starts[i] = at
          at += len(ids)
          ids_file.write(np.asarray(ids, dtype).tobytes())
          masks.write(np.asarray(mask, np.uint8).tobytes())
        now = time.monotonic()
        if verbose and (now - last >= 5 or (hi == len(docs) and now - start >= 5)):
          rate = hi / (now - start)
          print(f'tokenizing the {name} documents: {hi:,}/{len(docs):,}, {rate:,.0f} '
                f'documents/s, ETA {(len(docs) - hi) / rate:.0f}s', file=sys.stderr, flush=True)
          last = now
    with open(path + '.docs.npy' + _PARTIAL, 'wb') as f:
      np.save(f, starts)
  except BaseException:
    for side in sides:
      if os.path.exists(path + side + _PARTIAL):
        os.remove(path + side + _PARTIAL)
    raise
  for side in sides:
    os.replace(path + side + _PARTIAL, path + side)
  return TokenFileDocuments([path], np.dtype(dtype).name, vocab_size)


def _encode(docs, lo: int, hi: int, tokenizer, sft: bool):
  """(ids with EOS, loss mask or ()) of documents lo..hi-1."""
  eos = tokenizer.eos_id
  if not sft:
    return [(ids if tokenizer.ends_with_eos(ids) else ids + [eos], ()) for ids in
            tokenizer.encode_batch([docs[i] for i in range(lo, hi)])]
  return [tokenizer.encode_pieces(docs[i]) for i in range(lo, hi)]


class _Null:
  """A file that discards writes (no mask file for plain documents)."""

  def __enter__(self):
    return self

  def __exit__(self, *_):
    return False

  def write(self, data: bytes) -> None:
    del data


class TokenFileDocuments:
  """Documents of flat token files, each with a PATH.docs.npy index of start offsets and, for
  supervised fine-tuning, a PATH.mask.bin loss mask (uint8 per token); `tokenize` and the
  converter write them. Ids are checked against the vocabulary as they are read."""

  def __init__(self, paths: list[str], dtype: str, vocab_size: int):
    self.paths, self.dtype, self.vocab_size = paths, np.dtype(dtype), vocab_size
    files, starts, ends, masks = [], [], [], []  # per document: arrays, shared cheaply by workers
    for f, path in enumerate(paths):
      try:
        first = np.load(path + '.docs.npy').astype(np.int64)
      except (OSError, ValueError) as e:
        raise DataError(f'{path} has no readable document index {path}.docs.npy ({e}), which '
                        "data.packing='documents' needs; write the files with disttrain "
                        "convert --source=documents, or use data.packing='concat'") from e
      size = formats.token_count(path, self.dtype)
      if first.ndim != 1 or (not len(first) and size) or (len(first) and (
          first[0] != 0 or first[-1] > size or np.any(np.diff(first) < 0))):
        raise DataError(f'{path}.docs.npy is not the index of {path} (offsets from 0, rising, '
                        f'within its {size:,} tokens); write the pair again with disttrain convert')
      mask = path + '.mask.bin'
      if os.path.isfile(mask) and os.path.getsize(mask) != size:
        raise DataError(f'{mask} has {os.path.getsize(mask):,} bytes for the {size:,} tokens of '
                        f'{path}; write the pair again with disttrain convert')
      files.append(np.full(len(first), f, np.int32))
      starts.append(first)
      ends.append(np.append(first[1:], size) if len(first) else first)  # an empty shard: none
      masks.append(os.path.isfile(mask))
    if len(set(masks)) > 1:
      raise DataError(f'{paths}: some files have loss masks (.mask.bin) and some do not; use one '
                      'kind')
    self._files, self._starts = np.concatenate(files), np.concatenate(starts)
    self.lengths = np.concatenate(ends) - self._starts
    self.sft = masks[0]
    self._maps = None

  def __len__(self) -> int:
    return len(self.lengths)

  def __getstate__(self) -> dict:
    return {**self.__dict__, '_maps': None}  # workers map the files themselves

  def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Document i: (ids int32 [n], loss mask uint8 [n] or None)."""
    if self._maps is None:
      self._maps = [(np.memmap(p, self.dtype, mode='r'),
                     np.memmap(p + '.mask.bin', np.uint8, mode='r') if self.sft else None)
                    for p in self.paths]
    f, start = int(self._files[i]), int(self._starts[i])
    end = start + int(self.lengths[i])
    ids_map, mask_map = self._maps[f]
    ids = np.asarray(ids_map[start:end], np.int32)
    if ids.max(initial=0) >= self.vocab_size:
      raise DataError(f'{self.paths[f]}: token id {int(ids.max())} in document {i} is >= '
                      f'model.vocab_size={self.vocab_size}; raise model.vocab_size or check the '
                      'file (data.tokens.dtype)')
    return ids, (np.asarray(mask_map[start:end]) if mask_map is not None else None)


class DocRange:
  """Documents start..stop-1 of tokenized documents (a held-out tail, or the rest)."""

  def __init__(self, docs, start: int, stop: int):
    self.docs, self.start = docs, start
    self.lengths, self.sft = docs.lengths[start:stop], docs.sft

  def __len__(self) -> int:
    return len(self.lengths)

  def tokens(self, i: int):
    return self.docs.tokens(self.start + i)


def plan(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Best fit decreasing: (row offsets [R + 1] into pieces, pieces [P, 3] of (document, first
  pair, pairs)). Each document's n - 1 pairs go whole into the fullest row that has room; a
  document with more pairs than a row fills whole rows first, its remainder is packed."""
  pairs = np.maximum(np.asarray(lengths, np.int64) - 1, 0)
  full = [(d, k * seq_len) for d in np.flatnonzero(pairs >= seq_len)
          for k in range(int(pairs[d]) // seq_len)]
  rests = [(int(pairs[d]) % seq_len, int(d)) for d in np.flatnonzero(pairs % seq_len)]
  rests.sort(key=lambda x: (-x[0], x[1]))  # longest first; ties in document order
  rows: list[list[tuple[int, int, int]]] = [[(int(d), int(s), seq_len)] for d, s in full]
  caps: list[int] = []  # sorted distinct room left in open rows
  rows_with: dict[int, list[int]] = {}  # room -> open rows with that much left
  for n, d in rests:
    start = int(pairs[d]) - n
    at = bisect.bisect_left(caps, n)
    if at == len(caps):
      row, room = len(rows), seq_len
      rows.append([])
    else:
      room = caps[at]
      row = rows_with[room].pop()
      if not rows_with[room]:
        del rows_with[room], caps[at]
    rows[row].append((d, start, n))
    room -= n
    if room:
      if room not in rows_with:
        rows_with[room] = []
        bisect.insort(caps, room)
      rows_with[room].append(row)
  offsets = np.cumsum([0] + [len(r) for r in rows])
  pieces = np.asarray([p for r in rows for p in r], np.int64).reshape(-1, 3)
  return offsets, pieces


class PackedDocuments:
  """packing='documents': row r of the best-fit plan as a feature dict (module docstring)."""

  def __init__(self, docs, seq_len: int):
    self.docs, self.seq_len = docs, seq_len
    self.offsets, self.pieces = plan(docs.lengths, seq_len)
    used = int(self.pieces[:, 2].sum()) if len(self.pieces) else 0
    self.padding_fraction = 1 - used / max(len(self) * seq_len, 1)

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, r: int) -> dict[str, np.ndarray]:
    if not 0 <= r < len(self):
      raise IndexError(f'row {r} out of range 0..{len(self) - 1}')
    t = self.seq_len
    row = {'tokens': np.zeros(t, np.int32), 'targets': np.full(t, -1, np.int32),
           'segment_ids': np.zeros(t, np.int32), 'positions': np.zeros(t, np.int32)}
    if self.docs.sft:
      row['loss_mask'] = np.zeros(t, np.int32)
    at = 0
    for segment, (d, start, n) in enumerate(self.pieces[self.offsets[r]:self.offsets[r + 1]], 1):
      ids, mask = self.docs.tokens(int(d))
      row['tokens'][at:at + n] = ids[start:start + n]
      row['targets'][at:at + n] = ids[start + 1:start + n + 1]
      row['segment_ids'][at:at + n] = segment
      row['positions'][at:at + n] = np.arange(n)
      if mask is not None:
        row['loss_mask'][at:at + n] = mask[start + 1:start + n + 1]
      at += n
    return row


class ConcatWindows:
  """packing='concat': window k = tokens [kT, kT + T] of the joined documents (module docstring)."""

  def __init__(self, docs, seq_len: int):
    self.docs, self.seq_len = docs, seq_len
    self.starts = np.concatenate([[0], np.cumsum(docs.lengths)])
    self.padding_fraction = 0.0

  def __len__(self) -> int:
    return max(int(self.starts[-1]) - 1, 0) // self.seq_len

  def __getitem__(self, k: int) -> dict[str, np.ndarray]:
    if not 0 <= k < len(self):
      raise IndexError(f'window {k} out of range 0..{len(self) - 1}')
    lo, hi = k * self.seq_len, (k + 1) * self.seq_len + 1
    d = int(np.searchsorted(self.starts, lo, side='right')) - 1
    ids, masks = [], []
    while self.starts[d] < hi:
      doc_ids, mask = self.docs.tokens(d)
      a, b = max(lo - self.starts[d], 0), min(hi, self.starts[d + 1]) - self.starts[d]
      ids.append(doc_ids[a:b])
      masks.append(mask[a:b] if mask is not None else None)
      d += 1
    window = np.concatenate(ids)
    row = {'tokens': window[:-1], 'targets': window[1:]}
    if self.docs.sft:
      row['loss_mask'] = np.concatenate(masks)[1:].astype(np.int32)
    return row

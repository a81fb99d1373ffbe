"""safetensors files read and written one tensor at a time (Hugging Face's weight format).

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}, '__metadata__': {...}} and the raw little-endian tensor bytes. The
`safetensors` package reads bfloat16 into numpy only through torch or jax, so this module parses
the header itself and memory-maps the data: reading a tensor touches that tensor's pages alone,
and writing streams each tensor as it is produced (to a local folder or a gs:// / s3:// URL). A
model split over several files has a
`model.safetensors.index.json` whose weight_map names each tensor's file.
"""

import json
import os
import struct
import sys
import time
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

from disttrain.errors import CheckpointError
from disttrain.storage import urls

DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
          'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8, 'U8': np.uint8,
          'BOOL': np.bool_}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = 'model.safetensors.index.json'
SINGLE = 'model.safetensors'


def _header(path: str) -> tuple[dict, int]:
  """(tensor entries, offset of the data) of one file."""
  try:
    with open(path, 'rb') as f:
      (length,) = struct.unpack('<Q', f.read(8))
      header = json.loads(f.read(length))
  except (OSError, struct.error, ValueError) as e:
    raise CheckpointError(f'{path} is not a readable safetensors file ({e}); re-download or '
                          're-export it') from e
  header.pop('__metadata__', None)
  return header, 8 + length


class Reader:
  """The tensors of a model directory (one or many .safetensors files), read lazily."""

  def __init__(self, directory: str):
    index = os.path.join(directory, INDEX)
    if os.path.isfile(os.path.join(directory, SINGLE)):  # transformers' order: it, the index
      files = [SINGLE]
    elif os.path.isfile(index):
      with open(index, encoding='utf-8') as f:
        weight_map = json.load(f)['weight_map']
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(n for n in os.listdir(directory) if n.endswith('.safetensors'))
    if not files:
      raise CheckpointError(f'{directory} has no *.safetensors weights; pass a Hugging Face model '
                            'directory saved with save_pretrained (safetensors)')
    self._where: dict[str, tuple[str, dict, int]] = {}
    for name in files:
      path = os.path.join(directory, name)
      if not os.path.isfile(path):
        raise CheckpointError(f'{index} names {name}, which is missing from {directory}')
      header, start = _header(path)
      size = os.path.getsize(path)
      for tensor, entry in header.items():
        begin, end = entry.get('data_offsets', (0, -1))
        dtype = DTYPES.get(entry.get('dtype'))
        if not 0 <= begin <= end <= size - start or dtype is not None and end - begin != int(
            np.prod(entry.get('shape', ()))) * np.dtype(dtype).itemsize:
          raise CheckpointError(f'{path}: tensor {tensor} takes bytes {begin}..{end} of the '
                                f'{size - start} the file holds for {entry.get("shape")} '
                                f'{entry.get("dtype")}; the file is truncated or corrupt, '
                                're-download or re-export it')
        self._where[tensor] = (path, entry, start)
    self._maps: dict[str, np.memmap] = {}

  def names(self) -> list[str]:
    return sorted(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._where[name][1]['shape'])

  def read(self, name: str) -> np.ndarray:
    """The tensor as a read-only numpy array over the mapped file (no copy)."""
    path, entry, start = self._where[name]
    if entry['dtype'] not in DTYPES:
      raise CheckpointError(f'{path}: tensor {name} has dtype {entry["dtype"]}, which disttrain '
                            f'cannot read; supported: {sorted(DTYPES)}')
    if path not in self._maps:
      self._maps[path] = np.memmap(path, np.uint8, mode='r')
    begin, end = entry['data_offsets']
    raw = self._maps[path][start + begin:start + end]
    return raw.view(DTYPES[entry['dtype']]).reshape(entry['shape'])


def write(directory: str, tensors: Iterable[tuple[str, tuple, np.dtype, Callable[[], np.ndarray]]],
          max_shard_bytes: int = 2 * 2**30, metadata: dict | None = None,
          file_name: str = SINGLE) -> list[str]:
  """Writes (name, shape, dtype, produce) tensors in order, each produced when written.

  Files hold at most `max_shard_bytes` (one tensor larger than that gets a file of its own);
  several files get Hugging Face's names (model-00001-of-00003.safetensors) and an index. Prints
  progress with rate and ETA on long exports. Returns the file names.
  """
  tensors = list(tensors)
  shards, size = [[]], 0
  for entry in tensors:
    nbytes = int(np.prod(entry[1])) * np.dtype(entry[2]).itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  names = ([file_name] if len(shards) == 1 else
           [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))])
  progress = _Progress(sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d, _ in tensors))
  for name, shard in zip(names, shards):
    _write_file(urls.join(directory, name), shard, metadata or {}, progress)
  if len(shards) > 1:
    weight_map = {t[0]: name for name, shard in zip(names, shards) for t in shard}
    urls.write_text(urls.join(directory, INDEX), json.dumps(
        {'metadata': {'total_size': progress.total}, 'weight_map': weight_map}, indent=2))
  if file_name == SINGLE:  # an earlier export's other layout: readers would pick one of the two
    kept = {*names, *([INDEX] if len(shards) > 1 else [])}
    for stale in [*urls.path(directory).glob('model-*-of-*.safetensors'),
                  urls.path(urls.join(directory, SINGLE)), urls.path(urls.join(directory, INDEX))]:
      if stale.name not in kept and stale.exists():
        stale.unlink()
  return names


def _write_file(path: str, tensors: list, metadata: dict, progress: '_Progress') -> None:
  header, offset = {'__metadata__': {k: str(v) for k, v in metadata.items()}}, 0
  for name, shape, dtype, _ in tensors:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {'dtype': _CODES[np.dtype(dtype)], 'shape': list(shape),
                    'data_offsets': [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header, separators=(',', ':')).encode()
  raw += b' ' * (-len(raw) % 8)  # the data starts 8-byte aligned
  with (urls.path(path).open('wb') if urls.is_bucket(path) else open(path, 'wb')) as f:
    f.write(struct.pack('<Q', len(raw)) + raw)
    for name, shape, dtype, produce in tensors:
      array = np.ascontiguousarray(produce(), dtype=dtype)
      if array.shape != tuple(shape):
        raise ValueError(f'{name}: produced shape {array.shape}, declared {tuple(shape)}')
      f.write(array.tobytes())
      progress.add(array.nbytes)


class _Progress:
  """'wrote 1.2 of 4.9 GiB, 310 MiB/s, ETA 12s' every few seconds on stderr."""

  def __init__(self, total: int):
    self.total, self.done, self.start, self.last = total, 0, time.monotonic(), time.monotonic()

  def add(self, nbytes: int) -> None:
    self.done += nbytes
    now = time.monotonic()
    if now - self.last >= 5 or (self.done == self.total and now - self.start >= 5):
      rate = self.done / max(now - self.start, 1e-9)
      print(f'wrote {self.done / 2**30:.2f} of {self.total / 2**30:.2f} GiB, '
            f'{rate / 2**20:.0f} MiB/s, ETA {(self.total - self.done) / rate:.0f}s',
            file=sys.stderr, flush=True)
      self.last = now

"""The built-in data sets held in memory as numpy arrays, and the split of a held-out tail.

digits (scikit-learn's 1,797 8x8 digits), mnist (IDX files; magic, header and sizes checked),
synthetic (Gaussian features and a linear teacher; random token rows) and text (byte windows of
text files). Each builder takes the whole Config and returns {'train_data', 'eval_data'}, dicts of
arrays ({'image': float32 [N, ...], 'label': int32 [N]}, or {'tokens', 'targets': int32 [N, L]});
disttrain.data.sources names them.
"""

import gzip
import importlib.util
import os
import sysconfig
import zlib

import numpy as np

from disttrain.config import Config
from disttrain.errors import DataError

_DIGITS_EVAL = 297  # 1797 digits -> 1500 train
_MNIST_EVAL = 2000  # the project's convention for the 10k t10k-only set: 8000 / 2000
_SYNTHETIC_EVAL = 1024
_TEXT_EVAL = 256  # windows
_SYNTHETIC_CLASSES = 10
_TEXT_VOCAB = 256  # byte-level tokens
_TEXT_SUFFIXES = ('.py', '.txt', '.md', '.rst')
_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension
_MNIST_CLASSES = 10


def eval_examples(cfg: Config, default: int) -> int:
  """cfg.data.eval_examples, or the source's default when it is -1."""
  return default if cfg.data.eval_examples == -1 else cfg.data.eval_examples


def split_tail(arrays: dict, eval_examples: int, what: str) -> dict:
  """First N - eval_examples rows train, the last eval_examples eval (file order)."""
  n = len(next(iter(arrays.values())))
  if eval_examples >= n:
    raise DataError(f'data.eval_examples={eval_examples} leaves no training data in {what} '
                    f'({n} examples); pass --config.data.eval_examples=N with N < {n}')
  cut = n - eval_examples
  return {'train_data': {k: v[:cut] for k, v in arrays.items()},
          'eval_data': {k: v[cut:] for k, v in arrays.items()} if eval_examples else None}


def digits() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's 1,797 8x8 digits (pixels 0..16 [N, 8, 8], labels [N]) as load_digits gives
  them, read from its data file: importing sklearn.datasets costs every run a second."""
  spec = importlib.util.find_spec('sklearn')
  path = os.path.join((spec and spec.submodule_search_locations or [''])[0], 'datasets', 'data',
                      'digits.csv.gz')
  if not os.path.isfile(path):  # another layout: the public loader
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
    raw = datasets.load_digits()
    return raw.images, raw.target
  rows = np.loadtxt(path, delimiter=',')
  return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


def build_digits(cfg: Config) -> dict:
  """The 1797 real 8x8 scikit-learn digits, scaled from 0..16 to [0, 1]."""
  images, labels = digits()
  arrays = {'image': (images.astype(np.float32) / 16.0)[..., None],
            'label': labels.astype(np.int32)}
  return split_tail(arrays, eval_examples(cfg, _DIGITS_EVAL), 'digits')


def build_synthetic(cfg: Config) -> dict:
  """Gaussian features labelled by a fixed random linear teacher, so the task is learnable."""
  # A fixed seed independent of the run seed: the data set is the same for every run.
  rng = np.random.default_rng(0)
  n, f = cfg.data.synthetic.examples, cfg.data.synthetic.features
  image = rng.standard_normal((n, f), dtype=np.float32)
  teacher = rng.standard_normal((f, _SYNTHETIC_CLASSES), dtype=np.float32) / np.sqrt(f)
  label = np.argmax(image @ teacher, axis=1).astype(np.int32)
  return split_tail({'image': image, 'label': label}, eval_examples(cfg, _SYNTHETIC_EVAL),
                     'synthetic')


def build_synthetic_tokens(cfg: Config) -> dict:
  """Uniform random ids in [0, model.vocab_size) as rows of data.seq_len: a language model's data
  path without reading files, for benchmarks against trainers' synthetic data."""
  rng = np.random.default_rng(0)  # the same rows for every run, as build_synthetic
  rows = rng.integers(0, cfg.model.vocab_size, (cfg.data.synthetic.examples, cfg.data.seq_len + 1),
                      dtype=np.int32)
  return split_tail({'tokens': rows[:, :-1], 'targets': rows[:, 1:]},
                     eval_examples(cfg, _TEXT_EVAL), 'synthetic_tokens')


def _find(folder: str, prefix: str, kind: str) -> str | None:
  """The path of an IDX file such as train-images-idx3-ubyte[.gz], or None when absent."""
  what, idx = kind.split('-')
  for sep in ('-', '.'):  # train-images-idx3-ubyte or the common train-images.idx3-ubyte
    for ext in ('', '.gz'):
      path = os.path.join(folder, f'{prefix}-{what}{sep}{idx}-ubyte{ext}')
      if os.path.isfile(path):
        return path
  return None


def _read_idx(path: str, magic: int) -> np.ndarray:
  """Parses one (optionally gzipped) IDX file of unsigned bytes into a uint8 array."""
  try:
    with open(path, 'rb') as f:
      raw = f.read()
    if raw[:2] == b'\x1f\x8b':  # gzip magic, whatever the file is called
      raw = gzip.decompress(raw)
  except (OSError, EOFError, zlib.error) as e:
    raise DataError(f'{path} cannot be read ({e}); replace it with an intact MNIST IDX file') from e
  if len(raw) < 4 or int.from_bytes(raw[:4], 'big') != magic:
    found = raw[:4].hex() if len(raw) >= 4 else f'{len(raw)} bytes'
    raise DataError(f'{path} has a bad magic number ({found}, expected {magic:08x}); it is not an '
                    'MNIST IDX file of this kind, replace it')
  ndim = magic & 0xFF
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise DataError(f'{path} is truncated inside its header; replace it with an intact copy')
  shape = tuple(int(d) for d in np.frombuffer(raw, '>u4', ndim, offset=4))
  size = int(np.prod(shape))
  if len(raw) - header != size:
    raise DataError(f'{path} has {len(raw) - header} data bytes but its header {shape} needs '
                    f'{size}; the file is truncated or corrupt, replace it')
  return np.frombuffer(raw, np.uint8, size, offset=header).reshape(shape)


def _read_pair(folder: str, prefix: str) -> tuple[np.ndarray, np.ndarray] | None:
  """Reads the images and labels of one pair (train or t10k); None when neither file exists."""
  images_path = _find(folder, prefix, 'images-idx3')
  labels_path = _find(folder, prefix, 'labels-idx1')
  if images_path is None and labels_path is None:
    return None
  if images_path is None or labels_path is None:
    kind = 'images-idx3' if images_path is None else 'labels-idx1'
    missing = f'{prefix}-{kind}-ubyte'
    raise DataError(f'data.dir={folder!r} has {images_path or labels_path} but not {missing}[.gz]; '
                    'add the missing file')
  images = _read_idx(images_path, _IMAGES_MAGIC)
  labels = _read_idx(labels_path, _LABELS_MAGIC)
  if len(images) != len(labels):
    raise DataError(f'{images_path} has {len(images)} images but {labels_path} has {len(labels)} '
                    'labels; the pair does not match, replace them with a matching pair')
  if labels.size and labels.max() >= _MNIST_CLASSES:
    raise DataError(f'{labels_path} has label {int(labels.max())} outside 0..{_MNIST_CLASSES - 1}; '
                    'it is not an MNIST label file, replace it')
  # float32 in [0, 1] with a trailing channel axis, as the models expect.
  image = images.astype(np.float32)
  image *= np.float32(1 / 255)
  return image[..., None], labels.astype(np.int32)


def build_mnist(cfg: Config) -> dict:
  """MNIST IDX files: train/t10k pairs, or the t10k pair alone split by eval_examples."""
  folder = cfg.data.dir
  if not os.path.isdir(folder):
    problem = 'is not a directory' if os.path.exists(folder) else 'does not exist'
    raise DataError(f'data.dir={folder!r} {problem}; pass --config.data.dir=PATH to a folder '
                    'with MNIST IDX files')
  train = _read_pair(folder, 'train')
  test = _read_pair(folder, 't10k')
  if train is None and test is None:
    raise DataError(f'data.dir={folder!r} has no MNIST files; put t10k-images-idx3-ubyte[.gz] '
                    'and t10k-labels-idx1-ubyte[.gz] (and optionally the train-* pair) there')
  if train is None or test is None:
    image, label = train or test
    return split_tail({'image': image, 'label': label}, eval_examples(cfg, _MNIST_EVAL),
                       f'data.dir={folder!r}')
  if train[0].shape[1:] != test[0].shape[1:]:
    raise DataError(f'data.dir={folder!r}: train images are {train[0].shape[1:3]} but t10k images '
                    f'are {test[0].shape[1:3]}; use matching MNIST files')
  return {'train_data': {'image': train[0], 'label': train[1]},
          'eval_data': {'image': test[0], 'label': test[1]}}


def text_files(folder: str) -> list[str]:
  """The text source's files in reading order: '' = the standard library's top-level *.py."""
  if not folder:
    stdlib = sysconfig.get_paths()['stdlib']
    return sorted(os.path.join(stdlib, n) for n in os.listdir(stdlib) if n.endswith('.py'))
  if not os.path.isdir(folder):
    raise DataError(f'data.dir={folder!r} does not exist; pass a folder of text files, or '
                    "data.dir='' for the Python standard library's source")
  return sorted(os.path.join(root, n) for root, _, names in os.walk(folder) for n in names
                if n.endswith(_TEXT_SUFFIXES))


def text_bytes(folder: str, limit: int) -> np.ndarray:
  """The first `limit` bytes of the text files (text_files order) as uint8 token ids."""
  chunks, size = [], 0
  for path in text_files(folder):
    with open(path, 'rb') as f:
      chunks.append(f.read(limit - size))
    size += len(chunks[-1])
    if size >= limit:
      break
  return np.frombuffer(b''.join(chunks), np.uint8)


def build_text(cfg: Config) -> dict:
  """Byte-level language modelling: windows of seq_len + 1 bytes -> {'tokens', 'targets'}."""
  ids = text_bytes(cfg.data.dir, cfg.data.text.bytes).astype(np.int32)
  seq_len = cfg.data.seq_len
  n = (len(ids) - 1) // seq_len
  held_out = eval_examples(cfg, _TEXT_EVAL)
  if n <= held_out:
    raise DataError(f'data.dir={cfg.data.dir!r} gives {len(ids)} bytes = {n} windows of '
                    f'data.seq_len={seq_len}, not more than data.eval_examples={held_out}; '
                    'use more text (data.text.bytes, data.dir) or shorter windows')
  # Window k = bytes [k L, (k + 1) L]: the targets are the inputs shifted by one byte.
  starts = np.arange(n) * seq_len
  windows = ids[starts[:, None] + np.arange(seq_len + 1)]
  return split_tail({'tokens': windows[:, :-1], 'targets': windows[:, 1:]}, held_out,
                     'the text')


def unigram_entropy(targets: np.ndarray, vocab_size: int = _TEXT_VOCAB) -> float:
  """Entropy (nats) of the target ids: the loss of the best context-free model."""
  counts = np.bincount(np.asarray(targets).ravel(), minlength=vocab_size).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())

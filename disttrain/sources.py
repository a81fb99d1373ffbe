"""Loads a real (or synthetic) data set into memory as numpy arrays, split into train and eval.

Every split carries a global example id (the row in the source file order, unique across train and
eval) so that the pipeline's determinism and coverage can be checked example by example.
"""

import dataclasses
import gzip
import os
import sysconfig
import zlib

import numpy as np

from disttrain.config import DataConfig
from disttrain.errors import DataError

NUM_CLASSES = 10
_DIGITS_EVAL = 297  # 1797 digits -> 1500 train
_MNIST_EVAL = 2000  # the project's convention for the 10k t10k-only set: 8000 / 2000
_SYNTHETIC_EVAL = 1024
_TEXT_EVAL = 256  # windows
_TEXT_VOCAB = 256  # byte-level tokens
_TEXT_SUFFIXES = ('.py', '.txt', '.md', '.rst')
_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension


@dataclasses.dataclass(frozen=True)
class Split:
  """One split: images (float32), labels (int32) and global example ids (int32)."""
  image: np.ndarray
  label: np.ndarray
  id: np.ndarray

  def __len__(self) -> int:
    """Number of examples."""
    return int(self.label.shape[0])


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A train and an eval split and the number of classes."""
  train: Split
  eval: Split
  num_classes: int


def load(cfg: DataConfig) -> Dataset:
  """Loads the data set named by cfg.name."""
  if cfg.name == 'digits':
    return _digits(cfg)
  if cfg.name == 'mnist':
    return _mnist(cfg)
  if cfg.name == 'synthetic':
    return _synthetic(cfg)
  if cfg.name == 'text':
    return _text(cfg)
  raise DataError(f"data.name={cfg.name!r} is unknown; use 'digits', 'mnist', 'synthetic' or "
                  "'text'")


def _split_tail(image, label, eval_examples: int, what: str) -> Dataset:
  """Splits arrays in file order: the first N - eval_examples train, the last eval_examples eval."""
  n = len(label)
  if eval_examples >= n:
    raise DataError(f'data.eval_examples={eval_examples} leaves no training data in {what} '
                    f'({n} examples); pass --config.data.eval_examples=N with N < {n}')
  ids = np.arange(n, dtype=np.int32)
  cut = n - eval_examples
  return Dataset(train=Split(image[:cut], label[:cut], ids[:cut]),
                 eval=Split(image[cut:], label[cut:], ids[cut:]), num_classes=NUM_CLASSES)


def _eval_examples(cfg: DataConfig, default: int) -> int:
  """cfg.eval_examples, or the source's default when it is -1."""
  return default if cfg.eval_examples == -1 else cfg.eval_examples


def _digits(cfg: DataConfig) -> Dataset:
  """The 1797 real 8x8 scikit-learn digits, scaled from 0..16 to [0, 1]."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top  (slow import, digits only)
  raw = datasets.load_digits()
  image = (raw.images.astype(np.float32) / 16.0)[..., None]
  label = raw.target.astype(np.int32)
  return _split_tail(image, label, _eval_examples(cfg, _DIGITS_EVAL), 'digits')


def _synthetic(cfg: DataConfig) -> Dataset:
  """Gaussian features labelled by a fixed random linear teacher, so the task is learnable."""
  # A fixed seed independent of the run seed: the data set is the same for every run.
  rng = np.random.default_rng(0)
  n, f = cfg.synthetic_examples, cfg.synthetic_features
  image = rng.standard_normal((n, f), dtype=np.float32)
  teacher = rng.standard_normal((f, NUM_CLASSES), dtype=np.float32) / np.sqrt(f)
  label = np.argmax(image @ teacher, axis=1).astype(np.int32)
  return _split_tail(image, label, _eval_examples(cfg, _SYNTHETIC_EVAL), 'synthetic')


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
  if labels.size and labels.max() >= NUM_CLASSES:
    raise DataError(f'{labels_path} has label {int(labels.max())} outside 0..{NUM_CLASSES - 1}; '
                    'it is not an MNIST label file, replace it')
  # float32 in [0, 1] with a trailing channel axis, as the models expect.
  image = images.astype(np.float32)
  image *= np.float32(1 / 255)
  return image[..., None], labels.astype(np.int32)


def _mnist(cfg: DataConfig) -> Dataset:
  """MNIST IDX files: train/t10k pairs, or the t10k pair alone split by eval_examples."""
  folder = cfg.dir
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
    return _split_tail(image, label, _eval_examples(cfg, _MNIST_EVAL), f'data.dir={folder!r}')
  if train[0].shape[1:] != test[0].shape[1:]:
    raise DataError(f'data.dir={folder!r}: train images are {train[0].shape[1:3]} but t10k images '
                    f'are {test[0].shape[1:3]}; use matching MNIST files')
  # Both pairs: the real train/test split; ids continue from the train rows into the t10k rows.
  n = len(train[1])
  ids = np.arange(n + len(test[1]), dtype=np.int32)
  return Dataset(train=Split(train[0], train[1], ids[:n]), eval=Split(test[0], test[1], ids[n:]),
                 num_classes=NUM_CLASSES)


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


def _text(cfg: DataConfig) -> Dataset:
  """Byte-level language modelling: windows of seq_len + 1 bytes -> (tokens, next tokens)."""
  chunks, size = [], 0
  for path in text_files(cfg.dir):
    with open(path, 'rb') as f:
      chunks.append(f.read(cfg.text_bytes - size))
    size += len(chunks[-1])
    if size >= cfg.text_bytes:
      break
  ids = np.frombuffer(b''.join(chunks), np.uint8).astype(np.int32)
  n = (len(ids) - 1) // cfg.seq_len
  eval_examples = _eval_examples(cfg, _TEXT_EVAL)
  if n <= eval_examples:
    raise DataError(f'data.dir={cfg.dir!r} gives {len(ids)} bytes = {n} windows of data.seq_len='
                    f'{cfg.seq_len}, not more than data.eval_examples={eval_examples}; use more '
                    'text (data.text_bytes, data.dir) or shorter windows')
  # Window k = bytes [k L, (k + 1) L]: the targets are the inputs shifted by one byte.
  starts = np.arange(n) * cfg.seq_len
  tokens = ids[starts[:, None] + np.arange(cfg.seq_len + 1)]
  dataset = _split_tail(tokens[:, :-1], tokens[:, 1:], eval_examples, 'the text')
  return dataclasses.replace(dataset, num_classes=_TEXT_VOCAB)


def unigram_entropy(split: Split) -> float:
  """Entropy (nats) of the split's target bytes: the loss of the best context-free model."""
  counts = np.bincount(split.label.ravel(), minlength=_TEXT_VOCAB).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())

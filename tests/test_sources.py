"""Loading digits, MNIST IDX files and synthetic data; one-line DataErrors for bad input."""

import gzip
import pathlib
import shutil

import numpy as np
import pytest

from disttrain import config as config_lib
from disttrain.data import in_memory, sources
from disttrain.errors import DataError


def _load(**data_fields) -> dict:
  """{'train_data', 'eval_data'} of the built-in source these data.* fields describe."""
  cd = config_lib.defaults()
  for key, value in data_fields.items():
    node = cd.data
    *groups, leaf = key.split('__')
    for group in groups:
      node = node[group]
    node[leaf] = value
  return sources.build(config_lib.from_config_dict(cd))


def _write_idx(path: pathlib.Path, array: np.ndarray, magic: int | None = None) -> str:
  """Writes uint8 array as an IDX file (gzipped when the name ends in .gz)."""
  magic = (0x800 + array.ndim) if magic is None else magic
  raw = magic.to_bytes(4, 'big') + np.asarray(array.shape, '>u4').tobytes()
  raw += np.ascontiguousarray(array, np.uint8).tobytes()
  path.write_bytes(gzip.compress(raw) if path.name.endswith('.gz') else raw)
  return str(path)


def _write_pair(folder: pathlib.Path, prefix: str, n: int, seed: int = 0, ext: str = '') -> None:
  """A small random images/labels pair named like MNIST."""
  rng = np.random.default_rng(seed)
  _write_idx(folder / f'{prefix}-images-idx3-ubyte{ext}', rng.integers(0, 256, (n, 28, 28)))
  _write_idx(folder / f'{prefix}-labels-idx1-ubyte{ext}', rng.integers(0, 10, (n,)))


def _mnist(folder, **kwargs) -> dict:
  """Loads MNIST from folder."""
  return _load(name='mnist', dir=str(folder), **kwargs)


def _raises_one_line(fn, *names: str) -> str:
  """Checks fn raises a one-line DataError that names every given string."""
  with pytest.raises(DataError) as info:
    fn()
  message = str(info.value)
  assert '\n' not in message, message
  for name in names:
    assert name in message, (name, message)
  return message


def test_digits_shapes_ranges_and_split():
  ds = _load(name='digits')
  train, held_out = ds['train_data'], ds['eval_data']
  assert train['image'].shape == (1500, 8, 8, 1) and train['label'].shape == (1500,)
  assert held_out['image'].shape == (297, 8, 8, 1)
  for split in (train, held_out):
    assert split['image'].dtype == np.float32 and split['label'].dtype == np.int32
    assert 0.0 <= split['image'].min() and split['image'].max() == 1.0
    assert set(np.unique(split['label'])) == set(range(10))
  small = _load(name='digits', eval_examples=100)
  assert (len(small['train_data']['label']), len(small['eval_data']['label'])) == (1697, 100)


def test_digits_read_from_the_file_equal_sklearns_loader():
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  images, labels = in_memory.digits()
  raw = datasets.load_digits()
  np.testing.assert_array_equal(images, raw.images)
  np.testing.assert_array_equal(labels, raw.target)


def test_mnist_t10k_only_splits_8000_2000(mnist_dir):
  ds = _mnist(mnist_dir)
  train, held_out = ds['train_data'], ds['eval_data']
  assert train['image'].shape == (8000, 28, 28, 1) and held_out['image'].shape == (2000, 28, 28, 1)
  assert train['image'].dtype == np.float32
  for split in (train, held_out):
    assert split['image'].min() == 0.0 and split['image'].max() == 1.0
    assert 0 <= split['label'].min() and split['label'].max() == 9
  # The real test set starts with a 7 then a 2 (file order is kept).
  assert list(train['label'][:2]) == [7, 2]


def test_mnist_gzipped_and_plain_copies_are_equal(mnist_dir, tmp_path):
  gz, plain = tmp_path / 'gz', tmp_path / 'plain'
  gz.mkdir()
  plain.mkdir()
  for name in ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'):
    shutil.copy(pathlib.Path(mnist_dir) / f'{name}.gz', gz)
    with gzip.open(pathlib.Path(mnist_dir) / f'{name}.gz') as f:
      (plain / name).write_bytes(f.read())
  a, b = _mnist(gz, eval_examples=500), _mnist(plain, eval_examples=500)
  for split in ('train_data', 'eval_data'):
    for field in ('image', 'label'):
      np.testing.assert_array_equal(a[split][field], b[split][field])
  assert len(a['eval_data']['label']) == 500


def test_mnist_train_and_t10k_pairs(tmp_path):
  _write_pair(tmp_path, 'train', 30, seed=1)
  # The dot-separated variant of the names is accepted too.
  rng = np.random.default_rng(2)
  _write_idx(tmp_path / 't10k-images.idx3-ubyte.gz', rng.integers(0, 256, (12, 28, 28)))
  _write_idx(tmp_path / 't10k-labels.idx1-ubyte.gz', rng.integers(0, 10, (12,)))
  ds = _mnist(tmp_path)
  assert (len(ds['train_data']['label']), len(ds['eval_data']['label'])) == (30, 12)
  assert 0.0 <= ds['train_data']['image'].min() and ds['train_data']['image'].max() <= 1.0


def test_synthetic_is_fixed_and_learnable():
  fields = dict(name='synthetic', synthetic__examples=600, synthetic__features=16,
                eval_examples=100)
  a, b = _load(**fields), _load(**fields)
  train, held_out = a['train_data'], a['eval_data']
  assert train['image'].shape == (500, 16) and held_out['image'].shape == (100, 16)
  np.testing.assert_array_equal(train['image'], b['train_data']['image'])
  np.testing.assert_array_equal(train['label'], b['train_data']['label'])
  assert len(np.unique(train['label'])) == 10
  # A linear least-squares fit on train already beats chance by far on eval: the labels are linear.
  onehot = np.eye(10)[train['label']]
  w, *_ = np.linalg.lstsq(train['image'], onehot, rcond=None)
  assert np.mean(np.argmax(held_out['image'] @ w, 1) == held_out['label']) > 0.5


def test_synthetic_tokens_are_fixed_next_token_rows():
  fields = dict(name='synthetic_tokens', seq_len=16, synthetic__examples=50, eval_examples=10)
  a, b = _load(**fields), _load(**fields)
  train = a['train_data']
  assert train['tokens'].shape == (40, 16) and a['eval_data']['tokens'].shape == (10, 16)
  np.testing.assert_array_equal(train['tokens'], b['train_data']['tokens'])
  np.testing.assert_array_equal(train['targets'][:, :-1], train['tokens'][:, 1:])
  assert train['tokens'].min() >= 0 and train['tokens'].max() == 255  # uniform over 256 ids


def test_missing_dir():
  _raises_one_line(lambda: _mnist('/no/such/dir'), "data.dir='/no/such/dir'", 'does not exist',
                   '--config.data.dir')


def test_missing_files(tmp_path):
  _raises_one_line(lambda: _mnist(tmp_path), str(tmp_path), 't10k-images-idx3-ubyte')
  rng = np.random.default_rng(0)
  _write_idx(tmp_path / 't10k-images-idx3-ubyte', rng.integers(0, 256, (5, 28, 28)))
  _raises_one_line(lambda: _mnist(tmp_path), 't10k-labels-idx1-ubyte')


def test_bad_magic(tmp_path):
  _write_pair(tmp_path, 't10k', 20)
  labels = np.random.default_rng(0).integers(0, 10, (20,))
  path = _write_idx(tmp_path / 't10k-labels-idx1-ubyte', labels, magic=0x803)
  _raises_one_line(lambda: _mnist(tmp_path, eval_examples=5), path, 'magic')


def test_truncated_file(tmp_path):
  _write_pair(tmp_path, 't10k', 20)
  path = tmp_path / 't10k-images-idx3-ubyte'
  path.write_bytes(path.read_bytes()[:-100])
  _raises_one_line(lambda: _mnist(tmp_path, eval_examples=5), str(path), 'truncated')
  path.write_bytes(path.read_bytes()[:10])  # cut inside the header
  _raises_one_line(lambda: _mnist(tmp_path, eval_examples=5), str(path), 'truncated')


def test_truncated_gzip(tmp_path):
  _write_pair(tmp_path, 't10k', 20, ext='.gz')
  path = tmp_path / 't10k-images-idx3-ubyte.gz'
  path.write_bytes(path.read_bytes()[:-30])
  _raises_one_line(lambda: _mnist(tmp_path, eval_examples=5), str(path))


def test_count_mismatch(tmp_path):
  _write_pair(tmp_path, 't10k', 20)
  _write_idx(tmp_path / 't10k-labels-idx1-ubyte', np.zeros(19))
  _raises_one_line(lambda: _mnist(tmp_path, eval_examples=5), 't10k-images-idx3-ubyte',
                   't10k-labels-idx1-ubyte', '20', '19')


def test_label_out_of_range(tmp_path):
  _write_pair(tmp_path, 't10k', 20)
  _write_idx(tmp_path / 't10k-labels-idx1-ubyte', np.full(20, 12))
  _raises_one_line(lambda: _mnist(tmp_path, eval_examples=5), 't10k-labels-idx1-ubyte', '12')


def test_eval_examples_too_large(tmp_path):
  _write_pair(tmp_path, 't10k', 20)
  _raises_one_line(lambda: _mnist(tmp_path), 'data.eval_examples=2000', '20')
  _raises_one_line(lambda: _mnist(tmp_path, eval_examples=20), 'data.eval_examples=20')
  _raises_one_line(lambda: _load(name='digits', eval_examples=1797),
                   'data.eval_examples=1797', '1797')


def test_the_configs_source_lists_name_every_built_in_source():
  # The config checks files by these lists: a source added to SOURCES but not to one of them
  # would skip the 'needs data.train_files' / 'would ignore them' checks.
  known = set(config_lib.FILE_SOURCES) | set(config_lib.data.FILELESS_SOURCES)
  assert known == set(sources.SOURCES)
  assert not set(config_lib.FILE_SOURCES) & set(config_lib.data.FILELESS_SOURCES)
  assert set(config_lib.MIXABLE) <= set(config_lib.FILE_SOURCES)

"""Bad data through the launcher: one `error:` line naming the problem and the fix, exit 2,
no traceback, and a saved checkpoint survives a failure while reading.

Sources come from tests/configs/bad_data.py's get_data (picked by $BAD_DATA) or from flags.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from disttrain.data import formats
from disttrain.errors import DataError
from tests.conftest import ROOT, subprocess_env

CONFIG = 'tests/configs/bad_data.py'


def _env(case: str) -> dict:
  return subprocess_env(BAD_DATA=case)


def _launch(workdir, case: str = 'good', *flags: str, config: str = CONFIG, launcher=None):
  """`launcher`: conftest's forked launcher, for runs that stop before training."""
  if launcher is not None:
    return launcher.run(f'--config={config}', f'--workdir={workdir}', '--fake_devices=8', *flags,
                        env={'BAD_DATA': case}, timeout=180)
  return subprocess.run([sys.executable, 'launch/train.py', f'--config={config}',
                         f'--workdir={workdir}', '--fake_devices=8', *flags], cwd=ROOT,
                        env=_env(case), capture_output=True, text=True, timeout=180, check=False)


def _one_error_line(proc) -> str:
  output = proc.stdout + proc.stderr
  assert proc.returncode == 2, output[-3000:]
  assert 'Traceback' not in output, output[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(errors) == 1 and errors[0].startswith('error: '), proc.stderr
  return errors[0]


@pytest.fixture
def token_files(tmp_path):
  """A token file of 1001 uint16 ids (2,002 bytes), one of 3 bytes, one with an id of 300."""
  ids = np.arange(1001) % 256
  good = tmp_path / 'good.bin'
  ids.astype(np.uint16).tofile(good)
  (tmp_path / 'odd.bin').write_bytes(b'\x01\x02\x03')
  big = ids.copy()
  big[700] = 300
  big.astype(np.uint16).tofile(tmp_path / 'big.bin')
  return tmp_path


CASES = [
    ('fields', [], ["example 5 of the train data has fields ['extra', 'n', 'x', 'y']",
                    "example 0 has ['n', 'x', 'y']"], 'give every example the same fields'),
    ('shape', [], ["example 7 of the train data: field 'x' is float32[29]",
                   'in example 0 it is float32[30]'], 'make every example the same shape'),
    ('dtype', [], ["example 3 of the train data: field 'x' is float64[30]",
                   'in example 0 it is float32[30]'],
     'make every example the same shape and dtype'),
    ('empty', [], ['the train data is empty'], 'pass a source with at least one example'),
    ('no_len', [], ['the train data (generator) has no __len__ and __getitem__'],
     'pass a random-access source'),
    ('reserved', [], ["the train data has a field '_mask', a name disttrain reserves"],
     'rename it in the source or a transform'),
    pytest.param('transform', ['--config.data.workers=2'],
                 ['train transform FailsOn17 raised ValueError: cannot augment this one '
                  '(example 17'], 'fix the transform or that example', marks=pytest.mark.slow),
    ('good', ['--config.data.workers=100000'],
     ['data.workers=100000 is more than this machine can run'], 'use at most'),
]


@pytest.mark.parametrize('case,flags,needles,fix', CASES,
                         ids=[getattr(c, 'values', c)[0] for c in CASES])
def test_bad_source_is_one_line_and_exit_2(tmp_path, case, flags, needles, fix, launcher):
  workers = any(f.startswith('--config.data.workers=2') for f in flags)  # its own processes
  line = _one_error_line(_launch(tmp_path, case, *flags, launcher=None if workers else launcher))
  assert 'DataError' in line, line
  for needle in needles + [fix]:
    assert needle in line, (needle, line)


FILE_CASES = [
    ('glob', ['--config.data.name=array_record', '--config.data.train_files={dir}/none-*.ar'],
     ["data.train_files='{dir}/none-*.ar' matches no file"], 'pass a glob of existing files'),
    ('folder', ['--config.data.name=tokens', '--config.data.train_files={dir}'],  # a traceback
     ['data.train_files: {dir} is a directory'], 'pass files (a glob such as {dir}/*)'),
    ('token_size', ['--config.data.name=tokens', '--config.data.train_files={dir}/odd.bin'],
     ['odd.bin has 3 bytes, not a multiple of the 2-byte uint16 token size'],
     'check data.tokens.dtype'),
    pytest.param('token_id', ['--config.data.name=tokens',
                              '--config.data.train_files={dir}/big.bin',
                              '--config.data.eval_files={dir}/good.bin'],
                 ['big.bin: token id 300 at token 700 is >= model.vocab_size=256'],
                 'raise model.vocab_size', marks=pytest.mark.slow),
]


@pytest.mark.parametrize('case,flags,needles,fix', FILE_CASES,
                         ids=[getattr(c, 'values', c)[0] for c in FILE_CASES])
def test_bad_files_are_one_line_and_exit_2(token_files, tmp_path, case, flags, needles, fix,
                                           launcher):
  flags = [f.replace('{dir}', str(token_files)) for f in flags]
  # token_id fails on the first batch that holds token 700, after the step is compiled: one
  # layer, and a record every step (one compiled step, not a logged and a quiet one).
  lm = ['--config.model.name=gpt', '--config.model.hidden=16', '--config.model.num_heads=2',
        '--config.model.num_layers=1', '--config.log_every_steps=1',
        '--config.data.seq_len=16', '--config.global_batch_size=16', '--config.num_train_steps=40',
        '--config.data.eval_examples=8'] if case.startswith('token') else []
  line = _one_error_line(_launch(tmp_path / 'run', 'good', *lm, *flags,
                                 config='launch/configs/mnist_mlp.py',
                                 launcher=None if case == 'token_id' else launcher))  # it trains
  for needle in needles + [fix]:
    assert needle.replace('{dir}', str(token_files)) in line, (needle, line)


def test_fields_that_are_not_numbers_or_overflow_32_bits_are_one_line():
  """JAX computes in 32 bits: int64 ids of 2^40 wrapped to 0 and 1e300 became inf, silently;
  text or None fields failed at the first batch with a TypeError naming no field."""
  from disttrain.data.records import Records  # pylint: disable=g-import-not-at-top
  ids = np.asarray([2, 2**40, 1, 3])
  cases = [({'x': ids}, "in-memory train data: field 'x' holds 1099511627776, which int32"),
           ([{'x': ids[i]} for i in range(4)],
            "examples 1, 0 of the train data: field 'x' holds 1099511627776"),
           ({'x': np.asarray([2.0, 1e300])}, "field 'x' holds 1e+300, which float32"),
           ([{'x': 'abc'}], "example 0 of the train data: field 'x' is <U3 (str_ values), not "
                            'numbers'),
           ([{'x': None}], "field 'x' is object (NoneType values)"),
           ([{'x': [[1, 2], [3]]}], "example 0 of the train data: field 'x' is not one array")]
  for source, message in cases:
    with pytest.raises(DataError, match=re.escape(message)):
      Records(source, 'train', 0).read(np.asarray([1, 0]))
  np.testing.assert_array_equal(Records([{'x': np.int64(5)}, {'x': np.int64(-7)}], 'train', 0)
                                .read(np.asarray([1, 0]))['x'], [-7, 5])  # within int32: read
  # bfloat16 is a number too (its numpy kind is 'V': it was refused as "not numbers").
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  half = Records({'x': np.asarray([[1.5], [2.0]], ml_dtypes.bfloat16)}, 'train', 0)
  assert half.spec['x'].dtype == ml_dtypes.bfloat16
  assert half.read(np.asarray([1, 0]))['x'].tolist() == [[2.0], [1.5]]
  # One transform where a list goes (a TypeError traceback: 'Scale' object is not iterable).
  from disttrain.data.records import Data  # pylint: disable=g-import-not-at-top
  from disttrain.data.transforms import Scale  # pylint: disable=g-import-not-at-top
  scaled = Records(Data({'image': np.full((2, 3), 255, np.uint8)}, Scale()), 'train', 0)
  assert scaled.read(np.asarray([0]))['image'].max() == 1.0


def test_token_files_that_would_read_as_other_ids_are_refused(tmp_path):
  """A uint32 file read as uint16 (the default): its halves pass any vocabulary over 2^16, so
  windows and documents would be silent garbage; a stale document index or a loss mask of
  another length would drop documents or fail mid-run."""
  from disttrain.data import packing  # pylint: disable=g-import-not-at-top
  ids = np.random.default_rng(0).integers(0, 151_000, 1000)
  wide = tmp_path / 'wide.bin'
  ids.astype(np.uint32).tofile(wide)
  np.save(str(wide) + '.docs.npy', np.asarray([0, 400, 700]))
  for read in (lambda: formats.TokenWindows(str(wide), 16, vocab_size=152_000),
               lambda: packing.TokenFileDocuments([str(wide)], 'uint16', 152_000)):
    with pytest.raises(DataError, match='reads as a uint32 token file .* set '
                                        r'--config\.data\.tokens\.dtype=uint32'):
      read()
  assert len(formats.TokenWindows(str(wide), 16, 'uint32')) == 62  # the right dtype reads
  ids = ids % 50_000
  ids.astype(np.uint16).tofile(tmp_path / 'ids.bin')  # a uint16 file of the same ids passes
  assert len(formats.TokenWindows(str(tmp_path / 'ids.bin'), 16)) == 62
  path = str(tmp_path / 'ids.bin')
  for starts in ([0, 400, 1700], [0, 700, 400], [5, 400], []):  # [] for 1,000 tokens
    np.save(path + '.docs.npy', np.asarray(starts))
    with pytest.raises(DataError, match=r'ids.bin.docs.npy is not the index of .*convert'):
      packing.TokenFileDocuments([path], 'uint16', 1 << 16)
  np.save(path + '.docs.npy', np.asarray([0, 400, 700]))
  np.zeros(999, np.uint8).tofile(path + '.mask.bin')
  with pytest.raises(DataError, match=r'ids.bin.mask.bin has 999 bytes for the 1,000 tokens'):
    packing.TokenFileDocuments([path], 'uint16', 1 << 16)
  np.zeros(1000, np.uint8).tofile(path + '.mask.bin')
  docs = packing.TokenFileDocuments([path], 'uint16', 1 << 16)
  assert list(docs.lengths) == [400, 300, 300]
  np.testing.assert_array_equal(docs.tokens(1)[0], ids[400:700])
  empty = str(tmp_path / 'empty.bin')  # an empty shard of a hand-split corpus (a traceback)
  np.zeros(0, np.uint16).tofile(empty)
  np.save(empty + '.docs.npy', np.zeros(0, np.int64))
  np.zeros(0, np.uint8).tofile(empty + '.mask.bin')
  assert list(packing.TokenFileDocuments([empty, path], 'uint16', 1 << 16).lengths) == [400, 300,
                                                                                         300]


# A transform failing in a worker (FailsOn17) is one line: test_bad_source[transform]; a
# mid-run failure in workers that keeps the checkpoints and resumes:
# test_flipped_bytes_mid_run_are_one_line_and_keep_the_checkpoint.


# ------------------------------------------------------------------------------------------
# Damaged ArrayRecord shards: one line naming the file (and the record), exit 2, checkpoint kept.

def _shards(folder) -> str:
  """2 + 1 ArrayRecord shards of random 28 x 28 images (launch/configs/mnist_array_record.py's
  fields); returns the launcher flags that read them."""
  from disttrain.data import formats  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  examples = lambda n: [{'image': rng.random((28, 28, 1), np.float32),
                         'label': np.int32(i % 10)} for i in range(n)]
  formats.write_array_record(str(folder / 'train'), examples(256), 2)
  formats.write_array_record(str(folder / 'eval'), examples(64), 1)
  return [f'--config.data.train_files={folder}/train-*.array_record',
          f'--config.data.eval_files={folder}/eval-*.array_record',
          '--config.global_batch_size=64', '--config.eval_batch_size=64',
          '--config.model.hidden=32', '--config.log_every_steps=1',
          '--config.checkpoint_every_steps=2', '--config.eval_every_steps=0']


def _damage(path, how: str) -> None:
  data = bytearray(path.read_bytes())
  if how == 'truncate':
    path.write_bytes(data[:len(data) // 2])
  else:  # 2,000 flipped bytes in the middle half: records, not the index at the end
    rng = np.random.default_rng(1)
    for i in rng.choice(np.arange(len(data) // 4, 3 * len(data) // 4), 2000, replace=False):
      data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _launch_shards(workdir, flags, *extra):
  return _launch(workdir, 'good', *flags, *extra, config='launch/configs/mnist_array_record.py')


@pytest.mark.parametrize('workers', [0, 2])
def test_a_truncated_shard_is_one_line_at_start_up(tmp_path, workers):
  flags = _shards(tmp_path)
  _damage(tmp_path / 'train-00001-of-00002.array_record', 'truncate')
  line = _one_error_line(_launch_shards(tmp_path / 'run', flags, f'--config.data.workers={workers}',
                                        '--config.num_train_steps=4'))
  assert f'{tmp_path}/train-00001-of-00002.array_record: its index cannot be read' in line, line
  assert 'Corrupted Riegeli' in line and 'write it again' in line, line


@pytest.mark.slow
def test_flipped_bytes_mid_run_are_one_line_and_keep_the_checkpoint(tmp_path):
  """A run saves at step 4; the shard is damaged; the resumed run fails on its first read of a
  damaged record, read in this process (workers=0) and in worker processes (workers=2): one
  line naming the shard and the record, exit 2, step 4 kept; and with the shard written again
  the run resumes from step 4. (One saved run serves both worker counts.)"""
  flags = _shards(tmp_path)
  run = tmp_path / 'run'
  first = _launch_shards(run, flags, '--config.data.workers=2', '--config.num_train_steps=4')
  assert first.returncode == 0, first.stderr[-2000:]
  shard = tmp_path / 'train-00001-of-00002.array_record'
  intact = shard.read_bytes()
  _damage(shard, 'flip')
  for workers in (0, 2):
    line = _one_error_line(_launch_shards(run, flags, f'--config.data.workers={workers}',
                                          '--config.num_train_steps=40'))
    assert f'{shard}: record ' in line and 'cannot be read (Corrupted Riegeli' in line, \
        (workers, line)
    assert sorted(d for d in os.listdir(run / 'checkpoints') if d.isdigit()) == ['2', '4']
  shard.write_bytes(intact)
  again = _launch_shards(run, flags, '--config.data.workers=2', '--config.num_train_steps=6')
  assert again.returncode == 0 and 'resumed from step 4' in again.stdout, again.stderr[-2000:]

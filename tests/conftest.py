"""Every test process sees 8 fake CPU devices; set before JAX initialises its backend."""

import os
import pathlib
import tempfile

# XLA:CPU's LLVM at -O0 instead of -O2: the suite mostly compiles (sharded transformer steps
# whose compile dwarfs their run). -O1 compiled them about 25 % faster than -O2 (test_moe +
# test_long_run 129 s -> 100 s); -O0 another 26 % (test_gemma + test_llama's one-step checks
# 129 s -> 96 s; the quick tier 509 s -> 433 s) while the long trainings run 17 % slower
# (test_long_run + test_char_lm + test_jax_mlp 146 s -> 172 s), 2026-11-27. Every comparison in
# the suite is between programs built with the same flags. Subprocesses get these flags without
# the device count (SUBPROCESS_XLA_FLAGS): the launcher's --fake_devices decides theirs.
SUBPROCESS_XLA_FLAGS = '--xla_backend_optimization_level=0'
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + SUBPROCESS_XLA_FLAGS +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Tests build many identical steps (same model, config and devices), in this process and in the
# launcher and cluster subprocesses they start. One persistent compilation cache for the session,
# set in the environment so that those subprocesses share it, turns the repeats into cache reads
# (benchmarks/throughput.py sets a fresh cache of its own, so its compile_sec stays a cold
# compile) (measured: test_jax_mlp + test_equivalence 105 s -> 76 s in-process alone). A cached
# executable is the one a fresh compile builds, so bitwise comparisons between runs hold; trace
# counts, which tests assert, are unaffected (tracing still happens). Two workers may write one
# entry at once (jax writes entries in place, unlocked); an entry read half-written is a warning
# and a fresh compile in jax's _cache_read, never a failure. Multi-process CPU jobs turn it off
# themselves (parallel/distributed.py: with jax 0.12.1 their cached executables deadlocked).
_XLA_CACHE = tempfile.TemporaryDirectory(prefix='disttrain_tests_xla_cache_')
os.environ['JAX_COMPILATION_CACHE_DIR'] = _XLA_CACHE.name
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
MNIST_DIR = ROOT.parent / 'shared' / 'data' / 'mnist'


def subprocess_env(**extra: str) -> dict:
  """The environment of a process a test starts: CPU only, output unbuffered (a test reads it as
  it comes), the tests' XLA flags without the device count (--fake_devices decides), and `extra`."""
  return dict(os.environ, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1',
              XLA_FLAGS=SUBPROCESS_XLA_FLAGS, **extra)


@pytest.fixture(scope='session', autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, f'tests need 8 fake CPU devices, got {jax.devices()}'


@pytest.fixture(scope='session')
def launcher():
  """`launcher.run(*args, env={...})`: `python launch/train.py ARGS` as a fork of a process with
  the libraries imported (tests/forked_launcher.py), for runs that stop before training."""
  from tests import forked_launcher  # pylint: disable=g-import-not-at-top
  server = forked_launcher.Launcher(ROOT, subprocess_env())
  yield server
  server.close()


@pytest.fixture(scope='session')
def mnist_dir():
  if not (MNIST_DIR / 't10k-images-idx3-ubyte.gz').exists():
    pytest.fail(f'real MNIST test set missing at {MNIST_DIR} (../shared/data/mnist)')
  return str(MNIST_DIR)

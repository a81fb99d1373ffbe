"""Every test process sees 8 fake CPU devices; set before JAX initialises its backend."""

import os
import pathlib

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
MNIST_DIR = ROOT.parent / 'shared' / 'data' / 'mnist'


@pytest.fixture(scope='session', autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, f'tests need 8 fake CPU devices, got {jax.devices()}'


@pytest.fixture
def mnist_dir():
  if not (MNIST_DIR / 't10k-images-idx3-ubyte.gz').exists():
    pytest.fail(f'real MNIST test set missing at {MNIST_DIR} (../shared/data/mnist)')
  return str(MNIST_DIR)

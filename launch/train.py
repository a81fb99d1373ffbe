"""Train a config: python launch/train.py --config=launch/configs/mnist_mlp.py --workdir=DIR.

Flags: --fake_devices=N gives N CPU devices; --config.<field>=<value> overrides any config field.
Bad input (config, flags, data) exits with status 2 and one line naming the value and the fix.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (launch/configs/*.py).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for metrics, run.json, TensorBoard.')
_FAKE_DEVICES = flags.DEFINE_integer(
    'fake_devices', None, 'Run on N CPU devices (set before JAX initialises its backend).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}; use --config.<field>=<value>')
  import jax  # pylint: disable=g-import-not-at-top
  if _FAKE_DEVICES.value is not None:
    if _FAKE_DEVICES.value < 1:
      _fail(f'--fake_devices={_FAKE_DEVICES.value} must be >= 1')
    # Must happen before the first backend use; on CPU this gives N devices in this process.
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', _FAKE_DEVICES.value)
  import disttrain  # pylint: disable=g-import-not-at-top
  try:
    cfg = disttrain.from_config_dict(_CONFIG.value)
    disttrain.train(cfg, _WORKDIR.value)
  except disttrain.DisttrainError as e:
    _fail(f'{type(e).__name__}: {e}')


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(2)


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  logging.set_verbosity(logging.WARNING)
  app.run(main)

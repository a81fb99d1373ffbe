"""A tiny config whose get_data returns the bad source named by $BAD_DATA (tests/test_bad_data.py).

Module-level classes only: with data.workers > 0 the transforms are pickled into workers.
"""

import os

import grain
import numpy as np

from disttrain import config as config_lib

N = 128


def get_config():
  cfg = config_lib.defaults()
  cfg.model.name = 'jax_mlp'
  cfg.model.hidden = 16
  cfg.model.input_key = 'x'
  cfg.model.target_key = 'y'
  cfg.global_batch_size = 64
  cfg.num_train_steps = 4
  cfg.log_every_steps = 1
  cfg.checkpoint_every_steps = 2
  cfg.mesh.data = -1
  return cfg


def _arrays(n: int = N) -> dict:
  rng = np.random.default_rng(0)
  return {'x': rng.standard_normal((n, 30)).astype(np.float32),
          'y': (np.arange(n) % 2).astype(np.int32), 'n': np.arange(n, dtype=np.int32)}


class Examples:
  """A list-backed source whose example `at` is replaced by `odd`."""

  def __init__(self, at: int = -1, odd=None):
    arrays = _arrays()
    self.examples = [{k: v[i] for k, v in arrays.items()} for i in range(N)]
    if at >= 0:
      self.examples[at] = odd(self.examples[at])

  def __len__(self):
    return len(self.examples)

  def __getitem__(self, i):
    return self.examples[i]


class FailsOn17(grain.transforms.RandomMap):
  """A user augmentation with a bug that shows on one example."""

  def random_map(self, example, rng):
    if int(example['n']) == 17:
      raise ValueError('cannot augment this one')
    return {**example, 'x': example['x'] + rng.normal(size=30).astype(np.float32)}


def get_data(config):
  import disttrain  # pylint: disable=g-import-not-at-top
  case = os.environ.get('BAD_DATA', 'good')
  eval_data = _arrays(64)
  if case == 'good':
    return {'train_data': _arrays(), 'eval_data': eval_data}
  if case == 'fields':
    return {'train_data': Examples(5, lambda e: {**e, 'extra': np.float32(1)}),
            'eval_data': eval_data}
  if case == 'shape':
    return {'train_data': Examples(7, lambda e: {**e, 'x': e['x'][:29]}), 'eval_data': eval_data}
  if case == 'dtype':
    return {'train_data': Examples(3, lambda e: {**e, 'x': e['x'].astype(np.float64)}),
            'eval_data': eval_data}
  if case == 'empty':
    return {'train_data': [], 'eval_data': eval_data}
  if case == 'no_len':
    return {'train_data': (e for e in Examples().examples), 'eval_data': eval_data}
  if case == 'reserved':
    return {'train_data': {**_arrays(), '_mask': np.ones(N, np.float32)}, 'eval_data': eval_data}
  if case == 'transform':
    return {'train_data': disttrain.Data(_arrays(), [FailsOn17()]), 'eval_data': eval_data}
  raise ValueError(case)

"""A user's own data, model and task from a config file (tests/test_multihost_data.py).

get_data reads ArrayRecord shards of {'features', 'target'} (data.train_files / eval_files)
through a source that appends the indices of every batched read to $READS_DIR/reads_<p>.jsonl,
so a test can check that each process read only its rows.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import disttrain
from disttrain import config as config_lib
from disttrain.data import sources


def get_config():
  cfg = config_lib.defaults()
  cfg.data.name = 'array_record'
  cfg.global_batch_size = 64
  cfg.eval_batch_size = 64
  cfg.num_train_steps = 30
  cfg.learning_rate = 3e-3
  cfg.log_every_steps = 1
  cfg.checkpoint_every_steps = 10
  cfg.mesh.data = -1
  return cfg


class Recording:
  """A source that logs which examples each batched read asked for (one JSON line per read)."""

  def __init__(self, source, path: str):
    self.source, self.path = source, path

  def __len__(self):
    return len(self.source)

  def __getitem__(self, index):
    return self.source[index]

  def __getitems__(self, indices):
    with open(self.path, 'a', encoding='utf-8') as f:
      f.write(json.dumps([int(i) for i in indices]) + '\n')
    return [self.source[int(i)] for i in indices]


def get_data(config):
  files = sources.build(config)
  path = os.path.join(os.environ['READS_DIR'], f'reads_{jax.process_index()}.jsonl')
  return {'train_data': Recording(files['train_data'], path), 'eval_data': files['eval_data']}


def mlp_init(rng, x):
  k1, k2 = jax.random.split(rng)
  return {'w1': jax.random.normal(k1, (x.shape[-1], 64)) / np.sqrt(x.shape[-1]),
          'b1': jnp.zeros(64), 'w2': jax.random.normal(k2, (64, 2)) / 8.0, 'b2': jnp.zeros(2)}


def mlp_apply(params, x):
  return jax.nn.relu(x @ params['w1'] + params['b1']) @ params['w2'] + params['b2']


def get_model(config):
  del config
  return disttrain.FunctionalModel(mlp_init, mlp_apply, input_key='features')


def get_task(config):
  del config
  return disttrain.Classification(label_key='target')

"""Seed 004 part 1: raw-JAX params pytree 784-512-512-10, plain SGD with a simple decay, batch 32.

The seed decays 0.01 by x0.999 per step down to 1e-3 on 0..255 pixels; with [0, 1] pixels and
He-scaled weights (jax_mlp_init in disttrain/models/mlp.py) SGD starts at 0.05 and decays
linearly to 0 over the run. On MNIST (5 epochs of 8,000 images):
  --config.data.name=mnist --config.data.dir=../shared/data/mnist
"""

from disttrain import config as config_lib


def get_config():
  cfg = config_lib.defaults()
  cfg.model.name = 'jax_mlp'
  cfg.model.hidden = 512
  cfg.optimizer = 'sgd'
  cfg.learning_rate = 0.05
  cfg.lr_schedule = 'linear'
  cfg.global_batch_size = 32
  cfg.num_train_steps = 1250
  cfg.logical_rules = (('hidden', 'tensor'),)  # --config.mesh.tensor=2 splits the 512 features
  cfg.log_every_steps = 125
  cfg.eval_every_steps = 250
  return cfg

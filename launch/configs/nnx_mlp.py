"""The seed-004 model (Dense 512 -> Dropout -> BatchNorm, twice, Dense 10; Adam 1e-3) in Flax NNX.

Same hyper-parameters as mnist_mlp.py. On MNIST (312 steps = 5 epochs of 8,000 images):
  --config.data.name=mnist --config.data.dir=../shared/data/mnist --config.num_train_steps=312
"""

from disttrain import config as config_lib


def get_config():
  cfg = config_lib.defaults()
  cfg.model.name = 'nnx_mlp'
  cfg.model.hidden = 512
  cfg.model.dropout = 0.3
  cfg.optimizer = 'adam'
  cfg.learning_rate = 1e-3
  cfg.global_batch_size = 128
  cfg.num_train_steps = 300
  # The NNX params carry the same logical names as the Linen model: tensor splits 'hidden'.
  cfg.logical_rules = (('hidden', 'tensor'),)
  cfg.log_every_steps = 25
  cfg.eval_every_steps = 100
  return cfg

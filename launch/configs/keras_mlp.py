"""Seed 000: Keras functional 784-64-64-10 with an add_loss activity regulariser; Adam, batch 32.

Needs the keras extra (pip install '.[keras]'). On MNIST, 5 epochs of the 8,000 train images:
  --config.data.name=mnist --config.data.dir=../shared/data/mnist
"""

from disttrain import config as config_lib


def get_config():
  cfg = config_lib.defaults()
  cfg.model.name = 'keras_mlp'
  cfg.model.hidden = 64
  cfg.optimizer = 'adam'
  cfg.learning_rate = 1e-3
  cfg.global_batch_size = 32
  cfg.num_train_steps = 1250  # 5 epochs of 8,000 MNIST images
  cfg.log_every_steps = 125
  cfg.eval_every_steps = 250
  return cfg

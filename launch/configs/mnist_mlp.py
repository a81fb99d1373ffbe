"""The seed-004 MLP (Dense 512 -> Dropout -> BatchNorm, twice, Dense 10; Adam 1e-3).

Default example: 8x8 digits bundled with scikit-learn (no download). For MNIST:
  --config.data.name=mnist --config.data.dir=../shared/data/mnist --config.num_train_steps=312
(8,000 train images / 128 = 62 steps an epoch; 312 steps = 5 epochs.)
"""

from disttrain import config as config_lib


def get_config():
  cfg = config_lib.defaults()
  cfg.seed = 0
  cfg.global_batch_size = 128
  cfg.num_train_steps = 300
  cfg.learning_rate = 1e-3
  cfg.optimizer = 'adam'
  cfg.model.name = 'mnist_mlp'
  cfg.model.hidden = 512
  cfg.model.dropout = 0.3
  cfg.data.name = 'digits'
  cfg.mesh.data = -1
  # Tensor parallelism (e.g. --config.mesh.tensor=2) splits the 512-wide 'hidden' features.
  cfg.logical_rules = (('hidden', 'tensor'),)
  cfg.log_every_steps = 25
  cfg.eval_every_steps = 100
  return cfg

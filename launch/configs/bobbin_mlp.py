"""Seed 001 (bobbin): sigmoid Dense 1024 + Dropout(0.5) -> Dense 10, plain SGD 0.01, 8 devices.

bobbin pmaps over 8 devices; here the same data parallelism is jit over mesh.data (dropout masks
then do not depend on the layout); --config.step_mode=pmap runs it as bobbin does. The loss with
aux outputs and per-device losses (bobbin's StepInfo) are Python-API tasks (jit style): see
disttrain.models.task.LossWithAux and PerDeviceLoss. On MNIST:
  --config.data.name=mnist --config.data.dir=../shared/data/mnist
"""

from disttrain import config as config_lib


def get_config():
  cfg = config_lib.defaults()
  cfg.model.name = 'bobbin_mlp'
  cfg.model.hidden = 1024
  cfg.model.dropout = 0.5
  cfg.optimizer = 'sgd'
  cfg.learning_rate = 0.01
  cfg.global_batch_size = 64
  cfg.num_train_steps = 500  # bobbin's notebook: 500 batches of 64
  cfg.mesh.data = -1  # every device (8 with --fake_devices=8)
  cfg.log_every_steps = 50
  return cfg

"""The seed-004 MLP trained from ArrayRecord shards on disk, augmented in 2 worker processes.

  disttrain convert --source=mnist --data_dir=../shared/data/mnist --out=data/mnist
  python launch/train.py --config=launch/configs/mnist_array_record.py --workdir=runs/mnist_ar \
      --fake_devices=8

The converter writes the 8,000 train / 2,000 eval split of the t10k set as 4 + 4 shards of
encoded feature dicts {'image': float32 [28, 28, 1], 'label': int32}. The files are streamed
(random access per example), never loaded whole; get_data adds a random shift (+-2 pixels) and a
random erased square to every train example, drawn from (seed, epoch, example index), in
data.workers=2 processes.
"""

import disttrain
from disttrain import config as config_lib
from disttrain.data import sources
from disttrain.data.transforms import RandomErase, RandomShift


def get_config():
  cfg = config_lib.defaults()
  cfg.model.name = 'mnist_mlp'
  cfg.model.hidden = 512
  cfg.model.dropout = 0.3
  cfg.data.name = 'array_record'
  cfg.data.train_files = 'data/mnist/train-*.array_record'
  cfg.data.eval_files = 'data/mnist/eval-*.array_record'
  cfg.data.workers = 2
  cfg.global_batch_size = 128
  cfg.num_train_steps = 312  # 5 epochs of 8,000
  cfg.learning_rate = 1e-3
  cfg.mesh.data = -1
  cfg.logical_rules = (('hidden', 'tensor'),)
  cfg.log_every_steps = 52
  cfg.eval_every_steps = 104
  return cfg


def get_data(config):
  """The shards of data.train_files / eval_files, with augmentation on the train side."""
  files = sources.build(config)  # the array_record sources that data.name names
  return {'train_data': disttrain.Data(files['train_data'], [RandomShift(2), RandomErase(6)]),
          'eval_data': files['eval_data']}

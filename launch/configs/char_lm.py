"""A small byte-level GPT (disttrain/models/gpt.py) on the Python standard library's source.

  python launch/train.py --config=launch/configs/char_lm.py --workdir=runs/char --fake_devices=8

The logical rules split the model width over fsdp and heads / MLP features / vocabulary over
tensor, so e.g. --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2 holds about a
quarter of the weights per device. (Leave sharding='replicate': 'embed' already names fsdp.)
`model.name='char_lm'` still builds this GPT, with a deprecation warning.
"""

from disttrain import config as config_lib


def get_config():
  cfg = config_lib.defaults()
  cfg.data.name = 'text'
  cfg.data.seq_len = 128
  cfg.model.name = 'gpt'
  cfg.model.hidden = 128
  cfg.model.num_layers = 2
  cfg.model.num_heads = 4
  cfg.model.dropout = 0.0
  cfg.model.tied_embeddings = False
  cfg.optimizer = 'adam'
  cfg.learning_rate = 3e-3
  cfg.lr_schedule = 'cosine'
  cfg.warmup_steps = 20
  cfg.global_batch_size = 32
  cfg.num_train_steps = 300
  cfg.logical_rules = (('embed', 'fsdp'), ('heads', 'tensor'), ('mlp', 'tensor'),
                       ('vocab', 'tensor'))
  cfg.log_every_steps = 25
  cfg.eval_every_steps = 100
  cfg.eval_batch_size = 128
  return cfg

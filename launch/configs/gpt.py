"""A GPT-class decoder-only transformer (disttrain/models/gpt.py) on byte-level text or token files.

  python launch/train.py --config=launch/configs/gpt.py --workdir=runs/gpt --fake_devices=8
  python launch/train.py --config=launch/configs/gpt.py:gpt2_small ...   # GPT-2 small, 124 M

The default size trains on 2 CPU cores (4 x 128, byte vocabulary, the standard library's source);
the argument after ':' picks another size. Logical rules: the width ('embed') is split over fsdp,
attention heads, MLP features and the vocabulary over tensor, e.g. --config.mesh.data=2
--config.mesh.fsdp=2 --config.mesh.tensor=2 (leave sharding='replicate': 'embed' names fsdp).
Token files instead of the built-in text: --config.data.name=tokens
--config.data.train_files=DIR/train.bin --config.data.eval_files=DIR/eval.bin (written by
disttrain convert --source=text --format=tokens --out=DIR).
"""

from disttrain import config as config_lib
from disttrain.config import checks

# name -> (layers, width, heads, vocabulary, context, global batch)
SIZES = {
    'small': (4, 128, 4, 256, 128, 32),  # ~0.9 M parameters: CPU tests and examples
    'gpt2_small': (12, 768, 12, 50_257, 1_024, 32),  # GPT-2 small: 124 M parameters
    'gpt2_medium': (24, 1_024, 16, 50_257, 1_024, 32),  # 350 M
}


def get_config(size: str = 'small'):
  layers, width, heads, vocab, context, batch = checks.named_size(__file__, SIZES, size)
  cfg = config_lib.defaults()
  cfg.model.name = 'gpt'
  cfg.model.num_layers, cfg.model.hidden, cfg.model.num_heads = layers, width, heads
  cfg.model.vocab_size = vocab
  cfg.model.dropout = 0.0
  cfg.data.name = 'text'  # byte ids 0..255 fit every vocabulary above
  cfg.data.seq_len = context
  cfg.global_batch_size = batch
  cfg.optimizer = 'adamw'
  cfg.weight_decay = 0.1
  cfg.learning_rate = 3e-3 if size == 'small' else 6e-4
  cfg.lr_schedule = 'cosine'
  cfg.warmup_steps = 20
  cfg.num_train_steps = 300
  cfg.logical_rules = (('embed', 'fsdp'), ('heads', 'tensor'), ('mlp', 'tensor'),
                       ('vocab', 'tensor'))
  cfg.log_every_steps = 25
  cfg.eval_every_steps = 100
  cfg.eval_batch_size = 128
  return cfg

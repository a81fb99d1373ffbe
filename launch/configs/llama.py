"""A Llama-class decoder (disttrain/models/llama.py): RMSNorm, RoPE, SwiGLU, grouped-query
attention.

  python launch/train.py --config=launch/configs/llama.py --workdir=runs/llama --fake_devices=8
  python launch/train.py --config=launch/configs/llama.py:smollm2_135m \\
      --config.restore_from=PATH/TO/SmolLM2-135M ...            # fine-tune the published weights

The default size trains on 2 CPU cores (byte-level text of the standard library's source). The
named sizes carry the published config.json values of HuggingFaceTB/SmolLM2-135M and
meta-llama/Llama-3.2-1B, so `restore_from` a downloaded copy of either loads (the fields are checked
against its config.json). Logical rules: the width ('embed') over fsdp; query heads, K/V heads
(when their count divides the axis), MLP features and the vocabulary over tensor, e.g.
--config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2.
"""

from disttrain import config as config_lib
from disttrain.config import checks

# name -> model fields, then (context, global batch, learning rate)
SIZES = {
    'tiny': (dict(num_layers=4, hidden=128, num_heads=4, num_kv_heads=2, mlp_dim=384,
                  vocab_size=256, rope_theta=10_000.0, tied_embeddings=True), (128, 32, 3e-3)),
    'smollm2_135m': (dict(num_layers=30, hidden=576, num_heads=9, num_kv_heads=3, mlp_dim=1536,
                          vocab_size=49_152, rope_theta=100_000.0, tied_embeddings=True,
                          max_seq_len=8192), (2048, 32, 3e-4)),
    'llama3_1b': (dict(num_layers=16, hidden=2048, num_heads=32, num_kv_heads=8, mlp_dim=8192,
                       vocab_size=128_256, rope_theta=500_000.0, tied_embeddings=True,
                       max_seq_len=131_072), (2048, 32, 3e-4)),
}
# Llama 3.2's rope_scaling (rope_type 'llama3').
_LLAMA3_SCALING = dict(kind='llama3', factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_len=8192)


def get_config(size: str = 'tiny'):
  model, (context, batch, lr) = checks.named_size(__file__, SIZES, size)
  cfg = config_lib.defaults()
  cfg.model.name = 'llama'
  for field, value in model.items():
    cfg.model[field] = value
  if size == 'llama3_1b':
    for field, value in _LLAMA3_SCALING.items():
      cfg.model.rope_scaling[field] = value
  cfg.model.norm = 'rmsnorm'
  cfg.model.norm_eps = 1e-5
  cfg.model.dropout = 0.0
  cfg.data.name = 'text'  # byte ids 0..255 fit every vocabulary above
  cfg.data.seq_len = context
  cfg.global_batch_size = batch
  cfg.optimizer = 'adamw'
  cfg.weight_decay = 0.1
  cfg.learning_rate = lr
  cfg.lr_schedule = 'cosine'
  cfg.warmup_steps = 20
  cfg.num_train_steps = 300
  cfg.logical_rules = (('embed', 'fsdp'), ('heads', 'tensor'), ('kv_heads', 'tensor'),
                       ('mlp', 'tensor'), ('vocab', 'tensor'))
  cfg.log_every_steps = 25
  cfg.eval_every_steps = 100
  cfg.eval_batch_size = 128
  return cfg


def derived(model: dict, shape: tuple):
  """This file's training set-up for another family's model fields and (context, global batch,
  learning rate): what launch/configs/{mistral,qwen,gemma}.py build on."""
  cfg = get_config()
  for field, value in model.items():
    cfg.model[field] = value
  cfg.data.seq_len, cfg.global_batch_size, cfg.learning_rate = shape
  return cfg

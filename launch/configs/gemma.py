"""Gemma decoders (disttrain/models/gemma.py): Gemma 2 and the Gemma 3 text models.

  python launch/train.py --config=launch/configs/gemma.py --workdir=runs/gemma --fake_devices=8
  python launch/train.py --config=launch/configs/gemma.py:gemma3_1b \\
      --config.restore_from=PATH/TO/gemma-3-1b-it ...             # fine-tune the published weights

The default size is a small Gemma 3 that trains on 2 CPU cores (byte-level text of the standard
library's source): local layers with a window of 32 positions alternating with global ones in
rows of 128. gemma3_1b and gemma2_2b carry the published config.json values of
google/gemma-3-1b-pt and google/gemma-2-2b, so `restore_from` a downloaded copy loads (the
fields are checked against its config.json); their 262,144- and 256,000-id vocabularies make the
chunked cross-entropy (model.loss_chunk) the default. Everything else, logical rules included,
is launch/configs/llama.py's.
"""

import os
import runpy

from disttrain.config import checks

_GEMMA = dict(norm_eps=1e-6, tied_embeddings=True)
# name -> model fields, then (context, global batch, learning rate)
SIZES = {
    'tiny': (dict(name='gemma3', num_layers=4, hidden=128, num_heads=4, num_kv_heads=2,
                  head_dim=32, mlp_dim=384, vocab_size=256, rope_theta=1_000_000.0,
                  local_rope_theta=10_000.0, sliding_window=32, sliding_window_pattern=2,
                  query_pre_attn_scalar=32.0), (128, 32, 3e-3)),
    'gemma3_1b': (dict(name='gemma3', num_layers=26, hidden=1152, num_heads=4, num_kv_heads=1,
                       head_dim=256, mlp_dim=6912, vocab_size=262_144, rope_theta=1_000_000.0,
                       local_rope_theta=10_000.0, sliding_window=512, sliding_window_pattern=6,
                       query_pre_attn_scalar=256.0, max_seq_len=32_768), (2048, 32, 1e-5)),
    'gemma2_2b': (dict(name='gemma2', num_layers=26, hidden=2304, num_heads=8, num_kv_heads=4,
                       head_dim=256, mlp_dim=9216, vocab_size=256_000, rope_theta=10_000.0,
                       sliding_window=4096, sliding_window_pattern=2, query_pre_attn_scalar=256.0,
                       attn_softcap=50.0, final_softcap=30.0, max_seq_len=8192,
                       attention='xla'), (2048, 32, 1e-5)),
}


def get_config(size: str = 'tiny'):
  model, shape = checks.named_size(__file__, SIZES, size)
  llama = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama.py'))
  return llama['derived']({**_GEMMA, **model}, shape)

"""Mistral decoders (disttrain/models/mistral.py): Llama's decoder with sliding-window attention;
and Mixtral, the same decoder with routed experts (disttrain/models/mixtral.py).

  python launch/train.py --config=launch/configs/mistral.py --workdir=runs/mistral --fake_devices=8
  python launch/train.py --config=launch/configs/mistral.py:mistral_7b \\
      --config.restore_from=PATH/TO/Mistral-7B-v0.1 ...          # fine-tune the published weights

The default size trains on 2 CPU cores (byte-level text of the standard library's source) with a
window of 32 positions in rows of 128, so the window matters. mistral_7b carries the published
config.json values of mistralai/Mistral-7B-v0.1 (a 4,096-position window), mixtral_8x7b those of
mistralai/Mixtral-8x7B-v0.1, so `restore_from` a downloaded copy loads. Everything else, logical rules included, is launch/configs/llama.py's.
"""

import os
import runpy

from disttrain.config import checks

# name -> model fields, then (context, global batch, learning rate)
SIZES = {
    'tiny': (dict(num_layers=4, hidden=128, num_heads=4, num_kv_heads=2, mlp_dim=384,
                  vocab_size=256, rope_theta=10_000.0, tied_embeddings=False, sliding_window=32),
             (128, 32, 3e-3)),
    'mistral_7b': (dict(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, mlp_dim=14_336,
                        vocab_size=32_000, rope_theta=10_000.0, tied_embeddings=False,
                        sliding_window=4096, max_seq_len=32_768), (4096, 32, 1e-5)),
    # Mixtral (disttrain/models/mixtral.py): 8 experts, 2 per token, routed dropless as published.
    'mixtral_8x7b': (dict(name='mixtral', num_layers=32, hidden=4096, num_heads=32,
                          num_kv_heads=8, mlp_dim=14_336, num_experts=8, experts_per_token=2,
                          expert_capacity=0.0, router_aux_weight=0.02, router_z_weight=0.0,
                          vocab_size=32_000, rope_theta=1_000_000.0, tied_embeddings=False,
                          sliding_window=0, max_seq_len=32_768), (4096, 32, 1e-5)),
}


def get_config(size: str = 'tiny'):
  model, shape = checks.named_size(__file__, SIZES, size)
  llama = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama.py'))
  return llama['derived']({'name': 'mistral', **model}, shape)

"""Qwen decoders (disttrain/models/qwen.py): Llama's decoder with biases on the query, key and
value projections (qwen2: Qwen2, Qwen2.5) or RMSNorm on each head's queries and keys and a head
size set apart from the width (qwen3: the dense Qwen3 models), and Qwen3 with routed experts
(qwen3_moe: Qwen3-30B-A3B).

  python launch/train.py --config=launch/configs/qwen.py --workdir=runs/qwen --fake_devices=8
  python launch/train.py --config=launch/configs/qwen.py:qwen3_0_6b \\
      --config.restore_from=PATH/TO/Qwen3-0.6B ...               # fine-tune the published weights

The default size is a small Qwen3 that trains on 2 CPU cores (byte-level text of the standard
library's source). The named sizes carry the published config.json values of Qwen/Qwen2.5-0.5B,
Qwen/Qwen3-0.6B and Qwen/Qwen3-30B-A3B, so `restore_from` a downloaded copy loads (the fields are
checked against its config.json). Everything else, logical rules included, is launch/configs/llama.py's.
"""

import os
import runpy

from disttrain.config import checks

# name -> model fields, then (context, global batch, learning rate)
SIZES = {
    'tiny': (dict(name='qwen3', num_layers=4, hidden=128, num_heads=4, num_kv_heads=2,
                  head_dim=48, mlp_dim=384, vocab_size=256, rope_theta=1_000_000.0,
                  tied_embeddings=True), (128, 32, 3e-3)),
    'qwen2_5_0_5b': (dict(name='qwen2', num_layers=24, hidden=896, num_heads=14, num_kv_heads=2,
                          mlp_dim=4864, vocab_size=151_936, rope_theta=1_000_000.0,
                          tied_embeddings=True, max_seq_len=32_768), (2048, 32, 3e-4)),
    'qwen3_0_6b': (dict(name='qwen3', num_layers=28, hidden=1024, num_heads=16, num_kv_heads=8,
                        head_dim=128, mlp_dim=3072, vocab_size=151_936, rope_theta=1_000_000.0,
                        tied_embeddings=True, max_seq_len=40_960), (2048, 32, 3e-4)),
    # Qwen3-MoE: 128 experts of width 768, 8 per token, routed dropless as published.
    'qwen3_30b_a3b': (dict(name='qwen3_moe', num_layers=48, hidden=2048, num_heads=32,
                           num_kv_heads=4, head_dim=128, mlp_dim=768, num_experts=128,
                           experts_per_token=8, moe_norm_topk=True, expert_capacity=0.0,
                           router_aux_weight=0.001, router_z_weight=0.0, vocab_size=151_936,
                           rope_theta=1_000_000.0, tied_embeddings=False, max_seq_len=40_960),
                      (2048, 32, 1e-4)),
}


def get_config(size: str = 'tiny'):
  model, shape = checks.named_size(__file__, SIZES, size)
  llama = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama.py'))
  return llama['derived']({'norm_eps': 1e-6, **model}, shape)

"""GRPO from scratch on a small Llama: answer `a+b=` (single digits) with the sum in two digits
(`3+4=07`), rewarded for the exact answer (1), for each right digit (0.5 x their share) and for
a number close to the sum (0.5 x (1 - |error| / 10)).

  disttrain train --config=launch/configs/grpo_sums.py --workdir=runs/grpo_sums --fake_devices=8

Each step samples 8 completions of 2 bytes for each of 8 prompts of launch/data/sums.jsonl
(the 100 sums of two digits) on the training mesh, scores them with the two rewards below
(get_rewards; `--config.grpo.rewards=module.function,...` names importable ones instead) and
updates with group-normalized advantages. Records carry `reward`, `reward/exact_answer`, ...
(docs/post-training.md has the curve measured on 2 CPU cores; tests/test_grpo.py holds it).
"""

import os

from disttrain import config as config_lib

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'sums.jsonl')


def exact_answer(prompts, completions, answer, **unused):
  """1 where the completion is the answer as written, else 0."""
  del prompts, unused
  return [float(c == a) for c, a in zip(completions, answer)]


def right_digits(prompts, completions, answer, **unused):
  """0.5 x the share of the answer's digits the completion has in their place."""
  del prompts, unused
  return [0.5 * sum(x == y for x, y in zip(c, a)) / len(a) for c, a in zip(completions, answer)]


def close(prompts, completions, answer, **unused):
  """0.5 x (1 - |completion - answer| / 10), at least 0, where the completion is a number: a
  signal in every group, where exact answers are rare at first."""
  del prompts, unused
  return [0.5 * max(0.0, 1 - abs(int(c) - int(a)) / 10) if c.isdigit() else 0.0
          for c, a in zip(completions, answer)]


def get_rewards(config):
  del config
  return [exact_answer, right_digits, close]


def get_config():
  cfg = config_lib.defaults()
  cfg.model.name = 'llama'
  for field, value in dict(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, mlp_dim=192,
                           vocab_size=257, rope_theta=10_000.0, tied_embeddings=True).items():
    cfg.model[field] = value
  cfg.model.norm = 'rmsnorm'
  cfg.model.dropout = 0.0
  cfg.data.name = 'prompts'
  cfg.data.train_files = os.path.normpath(_DATA)
  cfg.data.seq_len = 8  # prompt bytes, left-padded
  cfg.grpo.group_size = 8
  cfg.grpo.max_new_tokens = 2  # the answer's two digits
  cfg.global_batch_size = 64  # completions: 8 prompts x 8
  cfg.optimizer = 'adam'
  cfg.learning_rate = 3e-3
  cfg.num_train_steps = 150
  cfg.log_every_steps = 10
  cfg.checkpoint_every_steps = 100
  cfg.logical_rules = (('embed', 'fsdp'), ('heads', 'tensor'), ('kv_heads', 'tensor'),
                       ('mlp', 'tensor'), ('vocab', 'tensor'))
  return cfg

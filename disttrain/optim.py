"""Optimizer and learning-rate schedule from the config."""

import optax

from disttrain.config import Config


def schedule(cfg: Config) -> optax.Schedule:
  """Learning rate as a function of the step (warm-up, then constant/cosine/linear decay)."""
  decay_steps = max(cfg.num_train_steps - cfg.warmup_steps, 1)
  main = {
      'constant': optax.constant_schedule(cfg.learning_rate),
      'cosine': optax.cosine_decay_schedule(cfg.learning_rate, decay_steps),
      'linear': optax.linear_schedule(cfg.learning_rate, 0.0, decay_steps),
  }[cfg.lr_schedule]
  if not cfg.warmup_steps:
    return main
  warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.join_schedules([warmup, main], [cfg.warmup_steps])


def build(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The gradient transformation and its schedule (the schedule is also logged)."""
  lr = schedule(cfg)
  tx = {
      'adam': lambda: optax.adam(lr),
      'adamw': lambda: optax.adamw(lr, weight_decay=cfg.weight_decay),
      'sgd': lambda: optax.sgd(lr, momentum=cfg.momentum or None),
  }[cfg.optimizer]()
  return tx, lr

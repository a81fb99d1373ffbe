"""Optimizer and learning-rate schedule from the config.

  clip_by_global_norm(grad_clip_norm) -> adam | adamw | sgd | adafactor | lion | muon (mu_dtype,
  decay mask) -> EMA of the parameters (ema_decay)

Weight decay (adamw, lion, adafactor) applies to weight matrices only: never to biases and norm
scales, and to embedding tables only with weight_decay_embeddings; `decayed_paths` lists them
(run.json). Muon (optax.contrib.muon) orthogonalises the momentum of the hidden weight matrices,
each layer's (and expert's) separately (`muon_axes`), and decays them; the embeddings, the output
head, norms, biases and LoRA adapters go to its AdamW part, undecayed (as nanochat does).

The exponential moving average lives in the optimizer state, so checkpoints keep it, it is
sharded like the parameters, and `ema_params` finds it for evals and exports. Records keep the
gradient norm before clipping.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from disttrain.config import Config
from disttrain.parallel import sharding as sharding_lib

_NO_DECAY = ('bias', 'scale', 'gamma', 'beta')  # biases and norm parameters (Flax, Keras names)
_EMBEDDINGS = ('embed', 'embedding', 'embeddings', 'positions', 'wte', 'wpe')  # Keras: embeddings
# The output heads (ours, Flax/NNX/Keras classifiers, transformers') and MoE routers: AdamW
# under muon, as modded-nanogpt keeps Muon to the hidden layers.
_ADAM_MATRICES = ('unembed', 'router', 'head', 'lm_head', 'predictions', 'classifier')
# DenseGeneral kernels with several input or output axes (disttrain's and Flax's attention), as
# (dimension numbers, least rank); axes before them (the scan's layers, fused qkv's 3) are a
# batch of separate matrices.
_MUON_MULTI_AXIS = {
    'query': (contrib.MuonDimensionNumbers(-3, (-2, -1)), 3),  # [..., D, N, K]
    'key': (contrib.MuonDimensionNumbers(-3, (-2, -1)), 3),
    'value': (contrib.MuonDimensionNumbers(-3, (-2, -1)), 3),
    'qkv': (contrib.MuonDimensionNumbers(-4, (-2, -1)), 4),  # [..., D, 3, N, K]
    'out': (contrib.MuonDimensionNumbers((-3, -2), -1), 3),  # [..., N, K, D]
}
_MUON_MATRIX = contrib.MuonDimensionNumbers(-2, -1)  # Dense kernels, MoE experts: [..., in, out]


def schedule(cfg: Config, peak: float | None = None) -> optax.Schedule:
  """Learning rate by step: linear warm-up from 0, then constant, cosine or linear decay to
  min_lr_ratio x peak, or warm-up-stable-decay (the last wsd_decay_fraction decays linearly).
  `peak`: another peak than cfg.learning_rate (muon's AdamW part), same shape."""
  peak = cfg.learning_rate if peak is None else peak
  end = peak * cfg.min_lr_ratio
  decay_steps = max(cfg.num_train_steps - cfg.warmup_steps, 1)
  if cfg.lr_schedule == 'wsd':
    # At most what warm-up leaves: a longer decay would end above min_lr_ratio at the last step.
    decay = min(max(int(round(cfg.wsd_decay_fraction * cfg.num_train_steps)), 1), decay_steps)
    main = optax.join_schedules([optax.constant_schedule(peak),
                                 optax.linear_schedule(peak, end, decay)],
                                [max(decay_steps - decay, 0)])
  else:
    main = {
        'constant': lambda: optax.constant_schedule(peak),
        'cosine': lambda: optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio),
        'linear': lambda: optax.linear_schedule(peak, end, decay_steps),
    }[cfg.lr_schedule]()
  if not cfg.warmup_steps:
    return main
  warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
  return optax.join_schedules([warmup, main], [cfg.warmup_steps])


def decays(path: str, ndim: int, embeddings: bool) -> bool:
  """Whether weight decay applies to the parameter at `path` ('blocks/mlp/up/kernel')."""
  parts = path.split('/')
  if parts[-1] in _NO_DECAY or any('norm' in p for p in parts):
    return False
  if any(p in _EMBEDDINGS for p in parts):
    return embeddings
  return ndim >= 2


def muon_axes(path: str, ndim: int) -> contrib.MuonDimensionNumbers | None:
  """How Muon sees the parameter at `path` as matrices, or None where AdamW updates it."""
  parts = path.split('/')
  if not decays(path, ndim, embeddings=False) or any(p in _ADAM_MATRICES for p in parts):
    return None
  if parts[-1] != 'kernel' and 'moe' not in parts:  # LoRA adapters ('a', 'b') and the like
    return None
  dims, rank = _MUON_MULTI_AXIS.get(parts[-2] if len(parts) > 1 else '', (None, 0))
  return dims if dims is not None and ndim >= rank else _MUON_MATRIX


def muon_dimension_numbers(params):
  """params -> a tree of MuonDimensionNumbers, None for AdamW (optax's
  muon_weight_dimension_numbers)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: muon_axes(sharding_lib.path_str(path), x.ndim), params)


def decay_mask(cfg: Config):
  """params -> a tree of booleans (optax's `mask` argument)."""
  def mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: decays(sharding_lib.path_str(path), x.ndim, cfg.weight_decay_embeddings),
        params)
  return mask


def decayed_paths(cfg: Config, params) -> list[str]:
  """The parameters weight decay applies to (run.json `weight_decay_paths`)."""
  if not cfg.weight_decay or cfg.optimizer not in ('adamw', 'lion', 'adafactor', 'muon'):
    return []
  if cfg.optimizer == 'muon':
    leaves = [(sharding_lib.path_str(path), x.ndim)
              for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    return [path for path, ndim in leaves if muon_axes(path, ndim) is not None]
  flags = jax.tree_util.tree_flatten_with_path(decay_mask(cfg)(params))[0]
  return [sharding_lib.path_str(path) for path, on in flags if on]


class EmaState(NamedTuple):
  """The moving average of the parameters after each update."""
  ema: Any


def ema(decay: float) -> optax.GradientTransformation:
  """Keeps ema = decay x ema + (1 - decay) x the updated parameters; updates pass through."""
  def init(params):
    return EmaState(ema=jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params))

  def update(updates, state, params):
    new = optax.apply_updates(params, updates)
    return updates, EmaState(ema=jax.tree.map(lambda e, p: decay * e + (1 - decay) * p,
                                              state.ema, new))
  return optax.GradientTransformation(init, update)


def ema_params(opt_state) -> Any:
  """The EMA of the parameters kept in `opt_state`, or None without one."""
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, EmaState))
           if isinstance(s, EmaState)]
  return found[0].ema if found else None


def decoupled_decay(lr: optax.Schedule, rate: float, mask) -> optax.GradientTransformation:
  """Adds -lr(step) x rate x p to the (signed) updates where mask(params) says: AdamW's decay,
  for adafactor, whose optax decay is not scaled by the learning rate (weight_decay=0.1 took
  10 % of every matrix each step, at learning_rate=0 too)."""
  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update(updates, state, params):
    step_lr = lr(state.count)
    updates = jax.tree.map(lambda u, p, on: (u - step_lr * rate * p).astype(u.dtype) if on else u,
                           updates, params, mask(params))
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))
  return optax.GradientTransformation(init, update)


def _base(cfg: Config, lr) -> optax.GradientTransformation:
  mu_dtype = jnp.dtype(cfg.mu_dtype) if cfg.mu_dtype else None
  b1 = lambda default: default if cfg.b1 < 0 else cfg.b1
  b2 = lambda default: default if cfg.b2 < 0 else cfg.b2
  mask = decay_mask(cfg)
  if cfg.optimizer == 'adam':
    return optax.adam(lr, b1(0.9), b2(0.999), mu_dtype=mu_dtype)
  if cfg.optimizer == 'adamw':
    return optax.adamw(lr, b1(0.9), b2(0.999), mu_dtype=mu_dtype, weight_decay=cfg.weight_decay,
                       mask=mask)
  if cfg.optimizer == 'lion':
    return optax.lion(lr, b1(0.9), b2(0.99), mu_dtype=mu_dtype, weight_decay=cfg.weight_decay,
                      mask=mask)
  if cfg.optimizer == 'muon':
    adam_lr = schedule(cfg, cfg.adam_learning_rate) if cfg.adam_learning_rate else lr
    return contrib.muon(lr, weight_decay=cfg.weight_decay, mu_dtype=mu_dtype, adam_b1=b1(0.9),
                        adam_b2=b2(0.999), adam_learning_rate=adam_lr,
                        muon_weight_dimension_numbers=muon_dimension_numbers)
  if cfg.optimizer == 'adafactor':
    base = optax.adafactor(lr, momentum=None if cfg.b1 < 0 else cfg.b1,
                           dtype_momentum=mu_dtype or jnp.float32)
    return optax.chain(base, decoupled_decay(lr, cfg.weight_decay, mask)) if cfg.weight_decay \
        else base
  return optax.sgd(lr, momentum=cfg.momentum or None, accumulator_dtype=mu_dtype)


def build(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The gradient transformation and its schedule (the schedule is also logged)."""
  lr = schedule(cfg)
  parts = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm else []
  parts.append(_base(cfg, lr))
  if cfg.ema_decay:
    parts.append(ema(cfg.ema_decay))
  return (parts[0] if len(parts) == 1 else optax.chain(*parts)), lr

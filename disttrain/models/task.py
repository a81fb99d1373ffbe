"""What is being learned: per-example losses and metrics from model outputs and a batch.

A task is any object with `per_example(outputs, batch) -> {'loss': [B], <metric>: [B], ...}`.
The step reduces every per-example value as sum(value * mask) over the *global* batch, divided by
the global sum of the examples' weights: never a mean of per-device means. Without a
`weights(batch) -> [B]` method an example weighs its mask (1 for real rows, 0 for padding) and
per-example values are means over the example; a task with `weights` returns per-example sums
and the weight each example carries (NextToken: its counted tokens), so the result is the
token-weighted mean whatever the packing, loss masks, devices or micro-batches.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from disttrain.data.records import MASK
from disttrain.errors import DataError
from disttrain.models import chunked_loss


@dataclasses.dataclass(frozen=True)
class Classification:
  """Softmax cross-entropy on integer targets read from batch[label_key]; accuracy.

  Targets are [B] (one class per example) or [B, T, ...] (one per token, e.g. next-token
  targets): per-token values are averaged over each example's tokens, so with equal-length
  windows the global mean over examples is also the exact mean over tokens. The loss is computed
  in float32 whatever the logits' dtype. A target outside 0..classes-1 makes the loss NaN (a
  gather would silently clamp it), so the run's NaN guard stops at that step.
  """
  label_key: str = 'label'

  def per_example(self, logits_BxC: jax.Array, batch: dict) -> dict[str, jax.Array]:
    labels = _labels(batch, self.label_key, logits_BxC.shape[:-1])
    logits_BxC = logits_BxC.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels)
    loss = jnp.where((labels >= 0) & (labels < logits_BxC.shape[-1]), loss, jnp.nan)
    correct = (jnp.argmax(logits_BxC, axis=-1) == labels).astype(jnp.float32)
    return {'loss': _mean_per_example(loss), 'accuracy': _mean_per_example(correct)}


def _labels(batch: dict, key: str, shape: tuple) -> jax.Array:
  """batch[key]: integer classes, one per output row; else one line (found while tracing)."""
  fields = sorted(k for k in batch if not k.startswith('_'))
  if key not in batch:
    raise DataError(f'the task reads its targets from batch field {key!r}, but the data has '
                    f'{fields}; name one of them (config: model.target_key; Classification\'s '
                    'label_key)')
  labels = batch[key]
  if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.shape != tuple(shape):
    raise DataError(f'batch field {key!r} holds the targets as {labels.dtype}{list(labels.shape)}, '
                    f'but the model gives {list(shape)} rows of classes; give integer classes of '
                    f'that shape (e.g. y.astype(int).reshape(-1) for [N, 1] labels)')
  return labels


def _mean_per_example(values: jax.Array) -> jax.Array:
  """[B, ...] -> [B]: the mean over everything but the batch axis."""
  return values.reshape(values.shape[0], -1).mean(axis=1)


@dataclasses.dataclass(frozen=True)
class NextToken:
  """Next-token cross-entropy of logits `[B, T, V]` against `batch[target_key]` `[B, T]`.

  A token counts where its target is >= 0 (-100 and other negative ids are ignored, as in Hugging
  Face) and, when the batch has `mask_key` (supervised fine-tuning's loss_mask), where that is
  nonzero. `weights` is each example's count of such tokens (times its row mask) and
  `per_example` the sums over them, so the step's loss is sum over counted tokens / their global
  count. A counted target >= V makes the loss NaN (a gather would silently clamp it), so the run's
  NaN guard stops at that step. Eval records add `num_tokens` and `perplexity` (per_token).
  A decoder with a chunked loss passes chunked_loss.Features, never the whole logits.
  """
  target_key: str = 'targets'
  mask_key: str = 'loss_mask'
  per_token = True

  def token_weights(self, batch: dict) -> jax.Array:
    """[B, T] float32: 1 where a token's loss counts."""
    weights = (batch[self.target_key] >= 0).astype(jnp.float32)
    if self.mask_key in batch:
      weights = weights * (batch[self.mask_key] != 0)
    return weights

  def weights(self, batch: dict) -> jax.Array:
    return self.token_weights(batch).sum(axis=-1) * batch[MASK]

  def per_example(self, logits_BxTxV: Any, batch: dict) -> dict[str, jax.Array]:
    extra = {}
    if isinstance(logits_BxTxV, dict):  # a mixture of experts: {'logits', 'moe_dropped': [B]}
      extra = {k: v for k, v in logits_BxTxV.items() if k != 'logits'}
      logits_BxTxV = logits_BxTxV['logits']
    targets_BxT = batch[self.target_key]
    weights_BxT = self.token_weights(batch)
    if isinstance(logits_BxTxV, chunked_loss.Features):  # the logits, a chunk at a time
      loss_B, correct_B = chunked_loss.sums(logits_BxTxV, targets_BxT, weights_BxT)
      return {'loss': loss_B, 'accuracy': correct_B, **extra}
    loss_BxT, correct_BxT = chunked_loss.token_values(logits_BxTxV.astype(jnp.float32),
                                                      targets_BxT, weights_BxT)
    return {'loss': loss_BxT.sum(-1), 'accuracy': correct_BxT.sum(-1), **extra}


@dataclasses.dataclass(frozen=True)
class LossWithAux:
  """A task from `loss_fn(outputs, batch) -> (loss [B], aux)`, like bobbin's compute_loss.

  `aux` is None or a dict of per-example [B] arrays; each is reported as a metric next to 'loss'
  (global-batch means, like the loss). Per-example rather than batch means, so the step can
  average over the global batch exactly whatever the layout.
  """
  loss_fn: Callable[[Any, dict], tuple[jax.Array, dict | None]]

  def per_example(self, outputs: Any, batch: dict) -> dict[str, jax.Array]:
    loss_B, aux = self.loss_fn(outputs, batch)
    return {'loss': loss_B, **(aux or {})}


@dataclasses.dataclass(frozen=True)
class PerDeviceLoss:
  """Adds 'loss_device_<d>': the mean loss over the d-th of `num_devices` row blocks.

  The global batch is laid out in contiguous row blocks over the batch axes (parallel/mesh.py),
  so block d is what device d holds when the batch is split over `num_devices` devices (bobbin's
  per-device StepInfo.loss). They are functions of the global batch, so they are the same numbers
  on any layout. step_mode=jit only: shard_map/pmap call the task on one device's rows, where
  the blocks would be wrong. Exact for batches without padding (train batches).
  """
  task: Any
  num_devices: int

  def per_example(self, outputs: Any, batch: dict) -> dict[str, jax.Array]:
    values = self.task.per_example(outputs, batch)
    loss_B = values['loss']
    block_B = jnp.arange(loss_B.shape[0]) // (loss_B.shape[0] // self.num_devices)
    for d in range(self.num_devices):
      # x num_devices: the step divides by the global count, a block holds 1/num_devices of it.
      values[f'loss_device_{d}'] = jnp.where(block_B == d, loss_B * self.num_devices, 0.0)
    return values

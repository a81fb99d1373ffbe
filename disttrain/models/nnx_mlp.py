"""Seed 004's MLP in Flax NNX: MnistMLP's layers, initialisers and logical axis names."""

import math

import jax
from flax import nnx

from disttrain.models.mlp import KERNEL, ONES, ZEROS


def _linear(din: int, dout: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(din, dout, kernel_init=nnx.with_partitioning(KERNEL, axes),
                    bias_init=nnx.with_partitioning(ZEROS, axes[1:]), rngs=rngs)


def _batch_norm(features: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
  # momentum 0.9 as the Linen model (NNX's default is 0.99).
  return nnx.BatchNorm(features, momentum=0.9, rngs=rngs,
                       scale_init=nnx.with_partitioning(ONES, ('hidden',)),
                       bias_init=nnx.with_partitioning(ZEROS, ('hidden',)))


class NnxMLP(nnx.Module):
  """Logical axes: 'hidden' marks the hidden features (the tensor-parallel dimension)."""

  def __init__(self, input_shape: tuple, num_classes: int = 10, hidden: int = 512,
               dropout: float = 0.3, *, rngs: nnx.Rngs):
    self.dense_0 = _linear(math.prod(input_shape), hidden, ('pixels', 'hidden'), rngs)
    self.norm_0 = _batch_norm(hidden, rngs)
    self.dense_1 = _linear(hidden, hidden, ('hidden_in', 'hidden'), rngs)
    self.norm_1 = _batch_norm(hidden, rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.head = _linear(hidden, num_classes, ('hidden_in', 'classes'), rngs)

  def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
    x = x_BxHxWxC.reshape(x_BxHxWxC.shape[0], -1)
    x = self.norm_0(self.dropout(nnx.relu(self.dense_0(x))))
    x = self.norm_1(self.dropout(nnx.relu(self.dense_1(x))))
    return self.head(x)

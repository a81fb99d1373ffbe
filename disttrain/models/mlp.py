"""The seeds' MNIST MLPs, side by side in the front ends they were written for.

  MnistMLP   seed 004 part 2, Flax Linen: (Dense 512 -> ReLU -> Dropout -> BatchNorm) x 2 -> Dense
  jax_mlp_*  seed 004 part 1, raw JAX: a list of (w, b) pairs and a vmapped one-example forward
  BobbinMLP  seed 001, Linen: Dense 1024 -> sigmoid -> Dropout(0.5) -> Dense
Seed 000's Keras model is in keras_mlp.py (keras is an optional extra), the NNX version of
seed 004's in nnx_mlp.py (imported when used: flax.nnx takes a while to import).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

KERNEL = nn.initializers.lecun_normal()
ZEROS = nn.initializers.zeros_init()
ONES = nn.initializers.ones_init()


class MnistMLP(nn.Module):
  """Logical axes: 'hidden' marks the 512-wide features (the tensor-parallel dimension)."""
  num_classes: int = 10
  hidden: int = 512
  dropout: float = 0.3
  axis_name: Any = None  # batch axes for BatchNorm statistics under shard_map / pmap

  @nn.compact
  def __call__(self, x_BxHxWxC: jnp.ndarray, train: bool) -> jnp.ndarray:
    x = x_BxHxWxC.reshape(x_BxHxWxC.shape[0], -1)
    in_axis = 'pixels'
    for _ in range(2):
      x = nn.Dense(self.hidden,
                   kernel_init=nn.with_logical_partitioning(KERNEL, (in_axis, 'hidden')),
                   bias_init=nn.with_logical_partitioning(ZEROS, ('hidden',)))(x)
      x = nn.relu(x)
      x = nn.Dropout(self.dropout, deterministic=not train)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name,
                       scale_init=nn.with_logical_partitioning(ONES, ('hidden',)),
                       bias_init=nn.with_logical_partitioning(ZEROS, ('hidden',)))(x)
      in_axis = 'hidden_in'
    return nn.Dense(self.num_classes,
                    kernel_init=nn.with_logical_partitioning(KERNEL, ('hidden_in', 'classes')),
                    bias_init=nn.with_logical_partitioning(ZEROS, ('classes',)))(x)


class BobbinMLP(nn.Module):
  """Seed 001's classifier: flatten -> Dense 1024 -> sigmoid -> Dropout(0.5) -> Dense classes."""
  num_classes: int = 10
  hidden: int = 1024
  dropout: float = 0.5

  @nn.compact
  def __call__(self, x_BxHxWxC: jnp.ndarray, train: bool) -> jnp.ndarray:
    x = x_BxHxWxC.reshape(x_BxHxWxC.shape[0], -1)
    x = nn.sigmoid(nn.Dense(self.hidden,
                            kernel_init=nn.with_logical_partitioning(KERNEL, ('pixels', 'hidden')),
                            bias_init=nn.with_logical_partitioning(ZEROS, ('hidden',)))(x))
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return nn.Dense(self.num_classes,
                    kernel_init=nn.with_logical_partitioning(KERNEL, ('hidden_in', 'classes')),
                    bias_init=nn.with_logical_partitioning(ZEROS, ('classes',)))(x)


def jax_mlp_init(rng: jax.Array, x: jax.Array, hidden: int = 512,
                 num_classes: int = 10) -> list[tuple[jax.Array, jax.Array]]:
  """[(w [out, in], b [out]), ...]: w ~ N(0, 2 / in) (He), b = 0.

  The seed draws N(0, 0.01^2), which trains only because its pixels are 0..255; with pixels in
  [0, 1] that network stays at chance for thousands of SGD steps, so the weights are He-scaled.
  """
  sizes = [math.prod(x.shape[1:]), hidden, hidden, num_classes]
  keys = jax.random.split(rng, len(sizes) - 1)
  return [(jax.random.normal(key, (n, m)) * jnp.sqrt(2.0 / m), jnp.zeros((n,)))
          for key, m, n in zip(keys, sizes[:-1], sizes[1:])]


def _jax_mlp_one(params, x_D: jax.Array) -> jax.Array:
  for w, b in params[:-1]:
    x_D = jax.nn.relu(jnp.dot(w, x_D) + b)
  w, b = params[-1]
  return jnp.dot(w, x_D) + b


def jax_mlp_apply(params, x: jax.Array) -> jax.Array:
  """Logits [B, classes]: the one-example forward, vmapped over the flattened batch."""
  return jax.vmap(_jax_mlp_one, in_axes=(None, 0))(params, x.reshape(x.shape[0], -1))


# Logical axes per (w, b), matching the Linen MLP's names ('hidden' -> tensor in the configs).
JAX_MLP_LOGICAL = [(('hidden', 'pixels'), ('hidden',)), (('hidden', 'hidden_in'), ('hidden',)),
                   (('classes', 'hidden_in'), ('classes',))]

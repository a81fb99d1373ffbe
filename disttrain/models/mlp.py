"""The seed-004 MLP: (Dense 512 -> ReLU -> Dropout -> BatchNorm) x 2 -> Dense classes."""

from typing import Any

import jax.numpy as jnp
from flax import linen as nn

_KERNEL = nn.initializers.lecun_normal()
_ZEROS = nn.initializers.zeros_init()
_ONES = nn.initializers.ones_init()


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
                   kernel_init=nn.with_logical_partitioning(_KERNEL, (in_axis, 'hidden')),
                   bias_init=nn.with_logical_partitioning(_ZEROS, ('hidden',)))(x)
      x = nn.relu(x)
      x = nn.Dropout(self.dropout, deterministic=not train)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name,
                       scale_init=nn.with_logical_partitioning(_ONES, ('hidden',)),
                       bias_init=nn.with_logical_partitioning(_ZEROS, ('hidden',)))(x)
      in_axis = 'hidden_in'
    return nn.Dense(self.num_classes,
                    kernel_init=nn.with_logical_partitioning(_KERNEL, ('hidden_in', 'classes')),
                    bias_init=nn.with_logical_partitioning(_ZEROS, ('classes',)))(x)

"""A small decoder-only transformer language model (Linen) with logical-axis annotations.

Every weight names its axes, so config `logical_rules` decide the layout; char_lm.py maps
  embed -> fsdp      the model width, split over fsdp in every weight that has it
  heads, mlp, vocab -> tensor   attention heads, MLP features and the vocabulary (Megatron style)
e.g. the query kernel W[D_fsdp, H_tensor, K] and the MLP's W_in[D_fsdp, F_tensor],
W_out[F_tensor, D_fsdp]. Pre-norm blocks, learned positions, no biases, causal softmax attention.
"""

import jax
from flax import linen as nn

from disttrain.models.gpt import causal_attention

_INIT = nn.initializers.normal(stddev=0.02)
_ONES = nn.initializers.ones_init()


def _weights(axes: tuple[str | None, ...], init=_INIT):
  return nn.with_logical_partitioning(init, axes)


def _norm(name: str) -> nn.LayerNorm:
  return nn.LayerNorm(use_bias=False, scale_init=_weights(('embed',), _ONES), name=name)


class Block(nn.Module):
  """x + attention(norm(x)); x + mlp(norm(x))."""
  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    d = x_BxTxD.shape[-1]
    head_dim = d // self.num_heads
    h = _norm('attention_norm')(x_BxTxD)
    qkv = [nn.DenseGeneral((self.num_heads, head_dim), use_bias=False, name=name,
                           kernel_init=_weights(('embed', 'heads', 'head_dim')))(h)
           for name in ('query', 'key', 'value')]
    attended_BxTxHxK = causal_attention(*qkv)
    x_BxTxD = x_BxTxD + nn.DenseGeneral(
        d, axis=(-2, -1), use_bias=False, name='out',
        kernel_init=_weights(('heads', 'head_dim', 'embed')))(attended_BxTxHxK)
    h = _norm('mlp_norm')(x_BxTxD)
    h = nn.gelu(nn.Dense(self.mlp_dim, use_bias=False, name='mlp_in',
                         kernel_init=_weights(('embed', 'mlp')))(h))
    return x_BxTxD + nn.Dense(d, use_bias=False, name='mlp_out',
                              kernel_init=_weights(('mlp', 'embed')))(h)


class CharTransformer(nn.Module):
  """Token ids [B, T] -> next-token logits [B, T, vocab]."""
  vocab_size: int = 256
  embed_dim: int = 128
  num_layers: int = 2
  num_heads: int = 4
  mlp_dim: int = 512

  @nn.compact
  def __call__(self, tokens_BxT: jax.Array, train: bool) -> jax.Array:
    del train  # no dropout: the step's losses do not depend on the layout
    t = tokens_BxT.shape[1]
    embed = nn.Embed(self.vocab_size, self.embed_dim, name='embed',
                     embedding_init=_weights(('vocab', 'embed'), nn.initializers.normal(1.0)))
    positions_TxD = self.param('positions', _weights((None, 'embed')), (t, self.embed_dim))
    x_BxTxD = embed(tokens_BxT) + positions_TxD
    for i in range(self.num_layers):
      x_BxTxD = Block(self.num_heads, self.mlp_dim, name=f'block_{i}')(x_BxTxD)
    x_BxTxD = _norm('final_norm')(x_BxTxD)
    return nn.Dense(self.vocab_size, use_bias=False, name='unembed',
                    kernel_init=_weights(('embed', 'vocab')))(x_BxTxD)

"""A GPT-class decoder-only transformer (Linen): pre-norm blocks scanned over layers.

  tokens [B, T] -> embed (+ learned positions) -> L x block -> norm -> logits [B, T, V]
  block: x + attention(norm(x)) (causal, softmax in float32); x + mlp(norm(x)) (GELU)

The blocks are one `nn.scan` over a leading 'layers' axis of every block weight, so a model of
any depth compiles as fast as one block; `remat` wraps the block in `nn.remat` with a
jax.checkpoint policy ('full' saves nothing, 'dots_saveable' keeps matmul outputs, ...). Every
weight names its logical axes (embed -> fsdp; heads, mlp, vocab -> tensor in launch/configs/gpt.py):
W_qkv[D_fsdp, H_tensor, K], W_out[H_tensor, K, D_fsdp], W_in[D_fsdp, F_tensor],
W_out[F_tensor, D_fsdp], embed[V_tensor, D_fsdp]. The vocabulary is padded to a multiple of
`vocab_multiple` (GPT-2's 50,257 -> 50,304, as nanoGPT does) so it splits evenly; padded ids get
a logit of -1e9, so they carry no probability and the loss is that of the real vocabulary.
`dtype` is the compute dtype of the activations (the parameters stay float32). Activations
name their axes too ('batch', then heads / mlp / vocab where split): under disttrain's jit
style 'batch' maps to the batch axes, so XLA keeps activations split by example while it
gathers fsdp-split weights, instead of splitting the width of both.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from disttrain import sharding
from disttrain.models.linen import LinenModel, model_inputs

_INIT = nn.initializers.normal(stddev=0.02)


def _weights(axes: tuple, init=_INIT):
  return nn.with_logical_partitioning(init, axes)


def _norm(kind: str, dtype, name: str) -> nn.Module:
  if kind == 'rmsnorm':
    return nn.RMSNorm(dtype=dtype, scale_init=_weights(('embed',), nn.initializers.ones_init()),
                      name=name)
  return nn.LayerNorm(dtype=dtype, scale_init=_weights(('embed',), nn.initializers.ones_init()),
                      bias_init=_weights(('embed',), nn.initializers.zeros_init()), name=name)


class Block(nn.Module):
  """One pre-norm block; (x, None) -> (x, None) so that nn.scan can carry x through layers."""
  num_heads: int
  mlp_dim: int
  norm: str
  dropout: float
  train: bool
  dtype: Any
  use_bias: bool = True

  @nn.compact
  def __call__(self, x_BxTxD: jax.Array, _) -> tuple[jax.Array, None]:
    d = x_BxTxD.shape[-1]
    head_dim = d // self.num_heads
    h = _norm(self.norm, self.dtype, 'attention_norm')(x_BxTxD)
    qkv_BxTx3xHxK = nn.DenseGeneral(
        (3, self.num_heads, head_dim), use_bias=self.use_bias, dtype=self.dtype, name='qkv',
        kernel_init=_weights(('embed', None, 'heads', 'head_dim')),
        bias_init=_weights((None, 'heads', 'head_dim'), nn.initializers.zeros_init()))(h)
    qkv_BxTx3xHxK = _constrain(qkv_BxTx3xHxK, ('batch', None, None, 'heads', None))
    attended_BxTxHxK = causal_attention(*(qkv_BxTx3xHxK[:, :, i] for i in range(3)))
    out_BxTxD = nn.DenseGeneral(d, axis=(-2, -1), use_bias=self.use_bias, dtype=self.dtype,
                                name='out', kernel_init=_weights(('heads', 'head_dim', 'embed')),
                                bias_init=_weights(('embed',), nn.initializers.zeros_init()))(
                                    attended_BxTxHxK)
    dropout = nn.Dropout(self.dropout, deterministic=not self.train)
    x_BxTxD = _constrain(x_BxTxD + dropout(out_BxTxD), ('batch', None, None))
    h = _norm(self.norm, self.dtype, 'mlp_norm')(x_BxTxD)
    h_BxTxF = nn.gelu(nn.Dense(self.mlp_dim, use_bias=self.use_bias, dtype=self.dtype,
                               name='mlp_in', kernel_init=_weights(('embed', 'mlp')),
                               bias_init=_weights(('mlp',), nn.initializers.zeros_init()))(h))
    h_BxTxF = _constrain(h_BxTxF, ('batch', None, 'mlp'))
    out_BxTxD = nn.Dense(d, use_bias=self.use_bias, dtype=self.dtype, name='mlp_out',
                         kernel_init=_weights(('mlp', 'embed')),
                         bias_init=_weights(('embed',), nn.initializers.zeros_init()))(h_BxTxF)
    return _constrain(x_BxTxD + dropout(out_BxTxD), ('batch', None, None)), None


def causal_attention(q_BxTxHxK: jax.Array, k_BxSxHxK: jax.Array,
                     v_BxSxHxK: jax.Array) -> jax.Array:
  """softmax(q k^T / sqrt(K), masked to s <= t) v, the softmax in float32."""
  t, head_dim = q_BxTxHxK.shape[1], q_BxTxHxK.shape[-1]
  logits_BxHxTxS = jnp.einsum('bthk,bshk->bhts', q_BxTxHxK, k_BxSxHxK) / jnp.sqrt(head_dim)
  causal_TxS = jnp.tril(jnp.ones((t, t), bool))
  logits_BxHxTxS = jnp.where(causal_TxS, logits_BxHxTxS.astype(jnp.float32), -1e9)
  logits_BxHxTxS = _constrain(logits_BxHxTxS, ('batch', 'heads', None, None))
  probs_BxHxTxS = jax.nn.softmax(logits_BxHxTxS, axis=-1).astype(v_BxSxHxK.dtype)
  return jnp.einsum('bhts,bshk->bthk', probs_BxHxTxS, v_BxSxHxK)


def _constrain(x: jax.Array, axes: tuple) -> jax.Array:
  """A logical sharding constraint (a no-op outside a jit-style step, e.g. in shard_map)."""
  return sharding.constrain(x, axes)


def _remat_policy(remat: str):
  return None if remat == 'full' else getattr(jax.checkpoint_policies, remat)


class GPT(nn.Module):
  """Token ids [B, T] -> next-token logits [B, T, vocab_size + padding] (padding at -1e9)."""
  vocab_size: int = 256
  width: int = 128
  num_layers: int = 4
  num_heads: int = 4
  mlp_dim: int = 512
  tied_embeddings: bool = True
  norm: str = 'layernorm'
  remat: str = 'none'
  dropout: float = 0.0
  dtype: Any = jnp.float32
  vocab_multiple: int = 128

  @property
  def padded_vocab(self) -> int:
    return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

  @nn.compact
  def __call__(self, tokens_BxT: jax.Array, train: bool) -> jax.Array:
    t = tokens_BxT.shape[1]
    embedding_VxD = self.param('embed', _weights(('vocab', 'embed')),
                               (self.padded_vocab, self.width))
    positions_TxD = self.param('positions', _weights((None, 'embed'), nn.initializers.normal(0.01)),
                               (t, self.width))
    x_BxTxD = (jnp.take(embedding_VxD, tokens_BxT, axis=0) + positions_TxD).astype(self.dtype)
    x_BxTxD = _constrain(x_BxTxD, ('batch', None, None))
    x_BxTxD = nn.Dropout(self.dropout, deterministic=not train)(x_BxTxD)
    block = Block
    if self.remat != 'none':
      block = nn.remat(Block, policy=_remat_policy(self.remat), prevent_cse=False)
    blocks = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True,
                                                                      'dropout': True},
                     length=self.num_layers, metadata_params={nn.PARTITION_NAME: 'layers'})
    x_BxTxD, _ = blocks(self.num_heads, self.mlp_dim, self.norm, self.dropout, train, self.dtype,
                        name='blocks')(x_BxTxD, None)
    x_BxTxD = _norm(self.norm, self.dtype, 'final_norm')(x_BxTxD)
    if self.tied_embeddings:
      logits_BxTxV = jnp.einsum('btd,vd->btv', x_BxTxD, embedding_VxD.astype(self.dtype))
    else:
      logits_BxTxV = nn.Dense(self.padded_vocab, use_bias=False, dtype=self.dtype,
                              name='unembed', kernel_init=_weights(('embed', 'vocab')))(x_BxTxD)
    logits_BxTxV = _constrain(logits_BxTxV, ('batch', None, 'vocab'))
    real_V = jnp.arange(self.padded_vocab) < self.vocab_size
    return jnp.where(real_V, logits_BxTxV.astype(jnp.float32), -1e9)


@dataclasses.dataclass(frozen=True)
class LanguageModel(LinenModel):
  """A Linen next-token model that counts tokens and model FLOPs (tokens/s and MFU records).

  FLOPs per token: 6 N + 12 L T D (PaLM's and nanoGPT's count: forward and backward of every
  weight matmul, plus attention's two T-long matmuls per layer), where N excludes the parameters
  only looked up (positions; the token embedding unless it is tied to the output layer).
  """
  input_key: Any = 'tokens'
  num_layers: int = 0
  width: int = 0
  lookup_params_per_position: int = 0  # positions table: width per position
  lookup_params: int = 0  # other looked-up-only parameters (an untied token embedding)

  def tokens_per_example(self, spec: dict) -> int:
    (tokens,) = model_inputs(spec, self.input_key)
    return int(tokens.shape[1])

  def flops_per_example(self, spec: dict, num_params: int) -> float:
    t = self.tokens_per_example(spec)
    n = num_params - self.lookup_params_per_position * t - self.lookup_params
    return float(t * (6 * n + 12 * self.num_layers * t * self.width))

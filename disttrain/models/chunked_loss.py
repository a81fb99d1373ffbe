"""Next-token cross-entropy that never holds the [B, T, V] logits.

A decoder's last matmul (hidden [B, T, D] x unembedding -> logits [B, T, V]) makes the largest
tensor of a language-model step once the vocabulary is large: Gemma's 262,144 ids at 2,048
tokens are 2 GiB of float32 logits per row, and the backward pass holds their gradient too.
With a chunked loss the decoder returns `Features` (its final hidden states and the unembedding
weight) instead, and `sums` walks the sequence in chunks: each chunk's logits are made, reduced
to per-token losses, turned into their gradients while they exist, and dropped (the FLOPs of the
whole logits; remaking them in the backward pass instead cost GPT-2 small 10 % of its step on an
H100). The values equal the full computation's to float32 rounding (tests/test_chunked_loss.py),
gradients included.

`model.loss_chunk` picks the chunk: a number of tokens, -1 never, 0 (default) auto: chunks of at
most ROW_BYTES of float32 logits per row, when a row's logits exceed two of them (so small
vocabularies keep the single matmul). run.json's `loss` records the choice.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from disttrain.models.layers import constrain

ROW_BYTES = 64 * 2**20  # auto: float32 logit bytes per row in one chunk


def chunk_tokens(setting: int, seq_len: int, padded_vocab: int) -> int:
  """Tokens per chunk for `model.loss_chunk=setting`; 0 = the whole sequence at once."""
  if setting < 0:
    return 0
  if setting == 0:
    row_bytes = 4 * padded_vocab * seq_len
    if row_bytes <= 2 * ROW_BYTES:
      return 0
    setting = -(-seq_len // -(-row_bytes // ROW_BYTES))  # even chunks of <= ROW_BYTES
  return 0 if setting >= seq_len else setting


def describe(setting: int, seq_len: int, padded_vocab: int) -> dict:
  """run.json's `loss`: how the cross-entropy is computed for rows of `seq_len` tokens."""
  chunk = chunk_tokens(setting, seq_len, padded_vocab)
  return {'chunked': bool(chunk), 'chunk_tokens': chunk or seq_len,
          'chunks': -(-seq_len // chunk) if chunk else 1,
          'logit_bytes_per_row': 4 * padded_vocab * (chunk or seq_len),
          'setting': setting}


def logits(hidden_BxTxD: jax.Array, unembed: jax.Array, tied: bool, vocab_size: int,
           dtype, softcap: float = 0.0) -> jax.Array:
  """Float32 logits [B, T, padded V], the padded ids at -1e9 (no probability); with `softcap`,
  c tanh(logits / c) first (Gemma 2's final cap).

  `unembed` is the token embedding [V, D] when tied, the unembedding kernel [D, V] otherwise.
  """
  spec = 'btd,vd->btv' if tied else 'btd,dv->btv'
  logits_BxTxV = jnp.einsum(spec, hidden_BxTxD.astype(dtype), unembed.astype(dtype))
  logits_BxTxV = constrain(logits_BxTxV, ('batch', 'sequence', 'vocab')).astype(jnp.float32)
  if softcap:
    logits_BxTxV = softcap * jnp.tanh(logits_BxTxV / softcap)
  real_V = jnp.arange(logits_BxTxV.shape[-1]) < vocab_size
  return jnp.where(real_V, logits_BxTxV, -1e9)


@struct.dataclass
class Features:
  """A decoder's output under a chunked loss: what the logits would be made from."""
  hidden_BxTxD: jax.Array
  unembed: jax.Array  # [V, D] tied, [D, V] otherwise
  vocab_size: int = struct.field(pytree_node=False)
  tied: bool = struct.field(pytree_node=False)
  chunk: int = struct.field(pytree_node=False)
  dtype: Any = struct.field(pytree_node=False)  # the matmul's compute dtype
  softcap: float = struct.field(pytree_node=False, default=0.0)

  def logits(self) -> jax.Array:
    """The full logits (for callers that want them; the loss never asks)."""
    return logits(self.hidden_BxTxD, self.unembed, self.tied, self.vocab_size, self.dtype,
                  self.softcap)


def token_values(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                 weights_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-token (loss, correct) [B, T], 0 where the weight is 0; a counted target >= V is NaN."""
  v = logits_BxTxV.shape[-1]
  safe_BxT = jnp.clip(targets_BxT, 0, v - 1)
  counted = weights_BxT > 0
  # optax's form, not logsumexp - take_along_axis by hand: with the latter, XLA:CPU deadlocked
  # an expert=8 train step (two collectives waiting on each other's threads, jax 0.12).
  loss_BxT = jnp.where(counted, optax.softmax_cross_entropy_with_integer_labels(
      logits_BxTxV, safe_BxT), 0.0)
  loss_BxT = jnp.where(counted & (targets_BxT >= v), jnp.nan, loss_BxT)
  correct_BxT = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT) * weights_BxT
  return loss_BxT, correct_BxT


def _chunks(features: Features, targets_BxT: jax.Array, weights_BxT: jax.Array):
  """(hidden [N, B, C, D], unembedding in float32, targets [N, B, C], weights [N, B, C]): N chunks
  of C tokens, the last padded with tokens of weight 0.

  Chunk i holds tokens i, i + N, i + 2N, ...: a sequence split over `context` in contiguous blocks
  stays split the same way within every chunk (a sum does not mind the order).
  """
  b, t, _ = features.hidden_BxTxD.shape
  c = features.chunk
  n = -(-t // c)

  def split(x):
    x = jnp.pad(x, ((0, 0), (0, n * c - t)) + ((0, 0),) * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, c, n, *x.shape[2:]), 2, 0)
  # The unembedding's gradient sums over chunks: keep that sum in float32.
  return (split(features.hidden_BxTxD), features.unembed.astype(jnp.float32), split(targets_BxT),
          split(weights_BxT))


def sums(features: Features, targets_BxT: jax.Array, weights_BxT: jax.Array,
         fused: bool = True) -> tuple[jax.Array, jax.Array]:
  """Per-row sums [B] of token_values over the sequence, one chunk of logits at a time.

  fused: each chunk's gradients are made in the forward pass, while its logits exist (three
  matmuls a chunk, as the whole logits take); the backward pass scales them by the rows'
  cotangents. That holds for the hidden states whatever the cotangents (rows are independent;
  kept in their dtype, so bf16 hidden states' gradients round once more than fused=False's) and
  for the unembedding when they are equal, as a mean over the batch makes them; otherwise the
  backward pass also remakes the logits for the unembedding's gradient (five matmuls a chunk,
  against fused=False's four). Reverse mode only (a custom_vjp: no jvp).
  """
  b = targets_BxT.shape[0]
  zeros = lambda: jnp.zeros((b,), jnp.float32)  # made inside: a custom_vjp closes over no tracer

  def values(h_BxCxD, w, targets_BxC, weights_BxC):
    logits_BxCxV = logits(h_BxCxD, w, features.tied, features.vocab_size, features.dtype,
                          features.softcap)
    loss_BxC, correct_BxC = token_values(logits_BxCxV, targets_BxC, weights_BxC)
    return loss_BxC.sum(-1), correct_BxC.sum(-1)

  def remade(h_NxBxCxD, w, targets_NxBxC, weights_NxBxC):
    @jax.checkpoint  # the backward pass remakes a chunk's logits instead of keeping them
    def chunk(carry, xs):
      loss_B, correct_B = values(xs[0], w, *xs[1:])
      return (carry[0] + loss_B, carry[1] + correct_B), None
    return jax.lax.scan(chunk, (zeros(), zeros()), (h_NxBxCxD, targets_NxBxC, weights_NxBxC))[0]

  @jax.custom_vjp
  def gradients_ahead(h_NxBxCxD, w, targets_NxBxC, weights_NxBxC):
    return remade(h_NxBxCxD, w, targets_NxBxC, weights_NxBxC)

  def forward(h_NxBxCxD, w, targets_NxBxC, weights_NxBxC):
    def chunk(carry, xs):
      h_BxCxD, targets_BxC, weights_BxC = xs
      loss_B, vjp, correct_B = jax.vjp(lambda h, w: values(h, w, targets_BxC, weights_BxC), h_BxCxD,
                                       w, has_aux=True)
      dh_BxCxD, dw = vjp(jnp.ones_like(loss_B))  # per row: d loss_B[b] / d h[b]; summed: w's
      return (carry[0] + loss_B, carry[1] + correct_B, carry[2] + dw), dh_BxCxD
    (loss_B, correct_B, dw), dh_NxBxCxD = jax.lax.scan(
        chunk, (zeros(), zeros(), jnp.zeros_like(w)), (h_NxBxCxD, targets_NxBxC, weights_NxBxC))
    return (loss_B, correct_B), (dh_NxBxCxD, dw, h_NxBxCxD, w, targets_NxBxC, weights_NxBxC)

  def backward(saved, cotangents):
    dh_NxBxCxD, dw, h_NxBxCxD, w, targets_NxBxC, weights_NxBxC = saved
    g_B = cotangents[0]
    dh = (dh_NxBxCxD * g_B[None, :, None, None]).astype(dh_NxBxCxD.dtype)
    unweighted = lambda: jax.vjp(lambda w: remade(h_NxBxCxD, w, targets_NxBxC,
                                                  weights_NxBxC)[0], w)[1](g_B)[0]
    dw = jax.lax.cond(jnp.all(g_B == g_B[0]), lambda: dw * g_B[0], unweighted)
    return dh, dw, None, None

  gradients_ahead.defvjp(forward, backward)
  parts = _chunks(features, targets_BxT, weights_BxT)
  return gradients_ahead(*parts) if fused else remade(*parts)


def token_losses(outputs: Any, targets_BxT: jax.Array, weights_BxT: jax.Array,
                 temperature: float = 1.0) -> jax.Array:
  """Per-token cross-entropy [B, T] of logits / temperature (full logits or Features, a chunk at
  a time): the negative log-probabilities a policy gradient needs token by token."""
  if not isinstance(outputs, Features):
    logits_BxTxV = outputs.astype(jnp.float32) / temperature
    return token_values(logits_BxTxV, targets_BxT, weights_BxT)[0]
  h_NxBxCxD, w, targets_NxBxC, weights_NxBxC = _chunks(outputs, targets_BxT, weights_BxT)

  @jax.checkpoint
  def chunk(_, xs):
    h_BxCxD, targets_BxC, weights_BxC = xs
    logits_BxCxV = logits(h_BxCxD, w, outputs.tied, outputs.vocab_size, outputs.dtype,
                          outputs.softcap) / temperature
    return None, token_values(logits_BxCxV, targets_BxC, weights_BxC)[0]

  _, loss_NxBxC = jax.lax.scan(chunk, None, (h_NxBxCxD, targets_NxBxC, weights_NxBxC))
  b, t = targets_BxT.shape
  return jnp.moveaxis(loss_NxBxC, 0, 2).reshape(b, -1)[:, :t]  # chunk i's j-th: token i + jN

"""Next-token cross-entropy that never holds the [B, T, V] logits.

A decoder's last matmul (hidden [B, T, D] x unembedding -> logits [B, T, V]) makes the largest
tensor of a language-model step once the vocabulary is large: Gemma's 262,144 ids at 2,048
tokens are 2 GiB of float32 logits per row, and the backward pass holds their gradient too.
With a chunked loss the decoder returns `Features` (its final hidden states and the unembedding
weight) instead, and `sums` walks the sequence in chunks: each chunk's logits are made, reduced
to per-token losses, turned into their gradients while they exist, and dropped (the FLOPs of the
whole logits; remaking them in the backward pass instead cost GPT-2 small 10 % of its step on an
H100). The values equal the full computation's to float32 rounding (tests/test_chunked_loss.py),
gradients included. `token_sums` does the same for an objective of each token's log-probability
(GRPO's clipped ratio and KL, models/grpo.py; tests/test_grpo.py).

`model.loss_chunk` picks the chunk: a number of tokens, -1 never, 0 (default) auto: chunks of at
most ROW_BYTES of float32 logits per row, when a row's logits exceed two of them (so small
vocabularies keep the single matmul). run.json's `loss` records the choice.
"""

from typing import Any, Callable

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


_PADDED = -1e9  # the logit of a padded vocabulary id
# A target at a padded id costs ~1e9 (/ temperature): no real token's loss comes near this.
_PADDED_LOSS = 1e7


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
  return jnp.where(real_V, logits_BxTxV, _PADDED)


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
  """Per-token (loss, correct) [B, T], 0 where the weight is 0; a counted target >= V, or at a
  padded id (>= vocab_size, its logit _PADDED), is NaN."""
  v = logits_BxTxV.shape[-1]
  safe_BxT = jnp.clip(targets_BxT, 0, v - 1)
  counted = weights_BxT > 0
  # optax's form, not logsumexp - take_along_axis by hand: with the latter, XLA:CPU deadlocked
  # an expert=8 train step (two collectives waiting on each other's threads, jax 0.12).
  loss_BxT = jnp.where(counted, optax.softmax_cross_entropy_with_integer_labels(
      logits_BxTxV, safe_BxT), 0.0)
  loss_BxT = jnp.where(counted & ((targets_BxT >= v) | (loss_BxT >= _PADDED_LOSS)), jnp.nan,
                       loss_BxT)
  correct_BxT = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT) * weights_BxT
  return loss_BxT, correct_BxT


def _split(x: jax.Array, c: int) -> jax.Array:
  """[B, T, ...] -> [N, B, C, ...]: N chunks of C tokens, the last padded with zeros.

  Chunk i holds tokens i, i + N, i + 2N, ...: a sequence split over `context` in contiguous blocks
  stays split the same way within every chunk (a sum does not mind the order).
  """
  b, t = x.shape[:2]
  n = -(-t // c)
  x = jnp.pad(x, ((0, 0), (0, n * c - t)) + ((0, 0),) * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(b, c, n, *x.shape[2:]), 2, 0)


def _unsplit(x_NxBxC: jax.Array, t: int) -> jax.Array:
  """_split's inverse for [N, B, C]: [B, T]."""
  return jnp.moveaxis(x_NxBxC, 0, 2).reshape(x_NxBxC.shape[1], -1)[:, :t]


def _scan_sums(values, h_NxBxCxD, w, per_chunk, per_row, fused: bool):
  """Per-row sums over chunks of `values(h_BxCxD, w, per_chunk's chunk, per_row) -> (primary
  [B], aux: a tuple of [B])`; the gradient flows through `primary` to h and w alone.

  fused: each chunk's gradients are made in the forward pass, while its logits exist (three
  matmuls a chunk, as the whole logits take); the backward pass scales them by the rows'
  cotangents. That holds for the hidden states whatever the cotangents (rows are independent;
  kept in their dtype, so bf16 hidden states' gradients round once more than fused=False's) and
  for the unembedding when they are equal, as a mean over the batch makes them; otherwise the
  backward pass also remakes the logits for the unembedding's gradient (five matmuls a chunk,
  against fused=False's four). Reverse mode only (a custom_vjp: no jvp).
  """
  b = h_NxBxCxD.shape[1]
  zeros = lambda: jnp.zeros((b,), jnp.float32)  # made inside: a custom_vjp closes over no tracer
  first = jax.tree.map(lambda x: x[0], (h_NxBxCxD, per_chunk))
  n_aux = len(jax.eval_shape(lambda h, c: values(h, w, c, per_row), *first)[1])

  def remade(h_NxBxCxD, w, per_chunk, per_row):
    @jax.checkpoint  # the backward pass remakes a chunk's logits instead of keeping them
    def chunk(carry, xs):
      primary_B, aux = values(xs[0], w, xs[1], per_row)
      return (carry[0] + primary_B, tuple(c + a for c, a in zip(carry[1], aux))), None
    return jax.lax.scan(chunk, (zeros(), tuple(zeros() for _ in range(n_aux))),
                        (h_NxBxCxD, per_chunk))[0]

  @jax.custom_vjp
  def gradients_ahead(h_NxBxCxD, w, per_chunk, per_row):
    return remade(h_NxBxCxD, w, per_chunk, per_row)

  def forward(h_NxBxCxD, w, per_chunk, per_row):
    def chunk(carry, xs):
      primary_B, vjp, aux = jax.vjp(lambda h, w: values(h, w, xs[1], per_row), xs[0], w,
                                    has_aux=True)
      dh_BxCxD, dw = vjp(jnp.ones_like(primary_B))  # per row: d primary[b] / d h[b]; summed: w's
      return (carry[0] + primary_B, tuple(c + a for c, a in zip(carry[1], aux)),
              carry[2] + dw), dh_BxCxD
    (primary_B, aux, dw), dh_NxBxCxD = jax.lax.scan(
        chunk, (zeros(), tuple(zeros() for _ in range(n_aux)), jnp.zeros_like(w)),
        (h_NxBxCxD, per_chunk))
    return (primary_B, aux), (dh_NxBxCxD, dw, h_NxBxCxD, w, per_chunk, per_row)

  def backward(saved, cotangents):
    dh_NxBxCxD, dw, h_NxBxCxD, w, per_chunk, per_row = saved
    g_B = cotangents[0]
    dh = (dh_NxBxCxD * g_B[None, :, None, None]).astype(dh_NxBxCxD.dtype)
    unweighted = lambda: jax.vjp(lambda w: remade(h_NxBxCxD, w, per_chunk, per_row)[0],
                                 w)[1](g_B)[0]
    dw = jax.lax.cond(jnp.all(g_B == g_B[0]), lambda: dw * g_B[0], unweighted)
    return dh, dw, jax.tree.map(lambda _: None, per_chunk), jax.tree.map(lambda _: None, per_row)

  gradients_ahead.defvjp(forward, backward)
  return (gradients_ahead if fused else remade)(h_NxBxCxD, w, per_chunk, per_row)


def _chunk_logits(features: Features, h_BxCxD: jax.Array, w: jax.Array) -> jax.Array:
  return logits(h_BxCxD, w, features.tied, features.vocab_size, features.dtype, features.softcap)


def sums(features: Features, targets_BxT: jax.Array, weights_BxT: jax.Array,
         fused: bool = True) -> tuple[jax.Array, jax.Array]:
  """Per-row sums [B] of token_values (loss, correct) over the sequence, one chunk of logits at a
  time; `fused`: see _scan_sums."""
  def values(h_BxCxD, w, per_chunk, _):
    loss_BxC, correct_BxC = token_values(_chunk_logits(features, h_BxCxD, w), *per_chunk)
    return loss_BxC.sum(-1), (correct_BxC.sum(-1),)

  c = features.chunk
  # The unembedding's gradient sums over chunks: keep that sum in float32.
  loss_B, (correct_B,) = _scan_sums(
      values, _split(features.hidden_BxTxD, c), features.unembed.astype(jnp.float32),
      (_split(targets_BxT, c), _split(weights_BxT, c)), (), fused)
  return loss_B, correct_B


def token_sums(outputs: Any, targets_BxT: jax.Array, weights_BxT: jax.Array, fn: Callable,
               per_token: dict, per_row: dict, temperature: float = 1.0, fused: bool = True):
  """Per-row sums [B] of a per-token objective of the log-probabilities (a policy gradient's):
  `fn(logp_BxT, weights_BxT, per_token, per_row) -> (value_BxT, aux: a tuple of [B, T])`,
  elementwise over tokens (`per_token`: [B, T] arrays, `per_row`: [B]), logp of the targets
  under logits / temperature. Returns (value sums [B], aux sums). With Features, chunk by chunk
  (`fused`: gradients made ahead, see _scan_sums); with full logits, at once."""
  if not isinstance(outputs, Features):
    logp_BxT = -token_losses(outputs, targets_BxT, weights_BxT, temperature)
    value_BxT, aux = fn(logp_BxT, weights_BxT, per_token, per_row)
    return value_BxT.sum(-1), tuple(a.sum(-1) for a in aux)

  def values(h_BxCxD, w, per_chunk, per_row):
    targets_BxC, weights_BxC, per_token = per_chunk
    logp_BxC = -token_values(_chunk_logits(outputs, h_BxCxD, w) / temperature, targets_BxC,
                             weights_BxC)[0]
    value_BxC, aux = fn(logp_BxC, weights_BxC, per_token, per_row)
    return value_BxC.sum(-1), tuple(a.sum(-1) for a in aux)

  c = outputs.chunk
  split = lambda x: _split(x, c)
  return _scan_sums(values, split(outputs.hidden_BxTxD), outputs.unembed.astype(jnp.float32),
                    (split(targets_BxT), split(weights_BxT), jax.tree.map(split, per_token)),
                    per_row, fused)


def token_losses(outputs: Any, targets_BxT: jax.Array, weights_BxT: jax.Array,
                 temperature: float = 1.0) -> jax.Array:
  """Per-token cross-entropy [B, T] of logits / temperature (full logits or Features, a chunk at
  a time): the negative log-probabilities of the sampler and a frozen reference (a trained
  policy's go through token_sums, whose gradients are made ahead)."""
  if not isinstance(outputs, Features):
    logits_BxTxV = outputs.astype(jnp.float32) / temperature
    return token_values(logits_BxTxV, targets_BxT, weights_BxT)[0]
  c, w = outputs.chunk, outputs.unembed.astype(jnp.float32)

  @jax.checkpoint
  def chunk(_, xs):
    h_BxCxD, targets_BxC, weights_BxC = xs
    logits_BxCxV = _chunk_logits(outputs, h_BxCxD, w) / temperature
    return None, token_values(logits_BxCxV, targets_BxC, weights_BxC)[0]

  _, loss_NxBxC = jax.lax.scan(chunk, None, (_split(outputs.hidden_BxTxD, c),
                                             _split(targets_BxT, c), _split(weights_BxT, c)))
  return _unsplit(loss_NxBxC, targets_BxT.shape[1])

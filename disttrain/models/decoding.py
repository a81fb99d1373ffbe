"""The compiled decode loop of the language models: prefill, then KV-cache decoding, one token per
step inside a `lax.while_loop`, until every row has produced a stop id or max_new tokens.

Used by `disttrain generate` (hf/generate.py), the scorer's greedy continuations
(evaluation/scoring.py) and GRPO's rollouts (training/rollout.py). Prompts are left-padded to
one length: padding is segment 0, which no token attends to, and positions count from each
prompt's first token. The cache is an argument and a result of the model, never training state.
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from disttrain.models.layers import Decode


def sample(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_k: int,
           top_p: float) -> jax.Array:
  """Next tokens [B]: argmax at temperature 0, else a draw from the tempered distribution
  restricted to the top_k tokens and to the smallest set whose probability reaches top_p."""
  if temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits = logits_BxV.astype(jnp.float32) / temperature
  if top_k:  # more than the vocabulary keeps it all, as transformers' TopKLogitsWarper
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    before = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1) - jax.nn.softmax(
        sorted_logits, axis=-1)
    sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)  # keeps the first one
    logits = jnp.full_like(logits, -jnp.inf).at[
        jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


TRACES = [0]  # times a loop was traced in this process (Generation.traces)


def decode_loop(module, max_new: int, stops: int | tuple[int, ...], temperature: float,
                top_k: int, top_p: float):
  """(params, prompt tokens, segments, positions [B, P], key) -> (new tokens, their log-probs)
  [B, N]; a row is done at its first id in `stops` (-1: none), then padded with stops[0]."""
  stops = stop_ids(stops) or (-1,)
  eos = stops[0]

  def run(params, tokens_BxP, segments_BxP, positions_BxP, key):
    TRACES[0] += 1
    b, p = tokens_BxP.shape
    cache = module.init_cache(b, p + max_new)
    kv_segments = jnp.zeros((b, p + max_new), jnp.int32).at[:, :p].set(segments_BxP)
    apply = lambda tokens, positions, segments, kv, at, cache: module.apply(
        {'params': params}, tokens, False, positions=positions, segment_ids=segments,
        decode=Decode(kv, at), cache=cache)
    def pick(logits_BxV, i):
      token = sample(logits_BxV, jax.random.fold_in(key, i), temperature, top_k, top_p)
      logprob = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV.astype(jnp.float32)),
                                    token[:, None], axis=-1)[:, 0]
      return token, logprob
    logits, cache = apply(tokens_BxP, positions_BxP, segments_BxP, kv_segments, 0, cache)
    token, logprob = pick(logits[:, -1], 0)
    out = (jnp.full((b, max_new), eos, jnp.int32), jnp.zeros((b, max_new), jnp.float32))
    done = jnp.zeros((b,), bool)
    state = (0, token, logprob, positions_BxP[:, -1] + 1, done, out, cache, kv_segments)

    def cond(state):
      i, _, _, _, done, *_ = state
      return (i < max_new) & ~jnp.all(done)

    def body(state):
      i, token, logprob, position, done, (out, logprobs), cache, kv = state
      out = out.at[:, i].set(jnp.where(done, eos, token))
      logprobs = logprobs.at[:, i].set(logprob)
      done = done | jnp.isin(token, jnp.asarray(stops, jnp.int32))
      kv = kv.at[:, p + i].set(1)
      logits, cache = apply(token[:, None], position[:, None], jnp.ones((b, 1), jnp.int32), kv,
                            p + i, cache)
      token, logprob = pick(logits[:, 0], i + 1)
      return i + 1, token, logprob, position + 1, done, (out, logprobs), cache, kv
    return jax.lax.while_loop(cond, body, state)[5]
  return run


def stop_ids(ids) -> tuple[int, ...]:
  """`ids` (None, one id, or a sequence of them) as a tuple of ints."""
  return () if ids is None else tuple(int(i) for i in np.ravel(ids))


def until_stop(row: np.ndarray, stops: Sequence[int]) -> np.ndarray:
  """The tokens of `row` before its first id in `stops` (all of them if none)."""
  ends = np.flatnonzero(np.isin(row, stops))
  return row[:ends[0]] if len(ends) else row


def left_padded(prompts: list[list[int]], length: int) -> tuple[np.ndarray, ...]:
  """(tokens, segments, positions) [B, length] int32 of prompts left-padded to `length`:
  padding is segment 0 at position 0, positions count from each prompt's first token."""
  tokens, segments, positions = (np.zeros((len(prompts), length), np.int32) for _ in range(3))
  for row, prompt in enumerate(prompts):
    tokens[row, length - len(prompt):] = prompt
    segments[row, length - len(prompt):] = 1
    positions[row, length - len(prompt):] = np.arange(len(prompt))
  return tokens, segments, positions

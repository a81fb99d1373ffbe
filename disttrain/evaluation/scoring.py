"""Batched log-likelihoods and greedy continuations of a language model on the training mesh.

  Scorer(model, batch_sharding, batch_size, max_len, stops)
    .loglikelihoods(params, mutable, requests) -> [(sum of log p(continuation | context),
                                                    every continuation token is the argmax)]
    .greedy(params, mutable, prompts, max_new) -> [new token ids, up to and excluding a stop]

Requests are sorted longest first (as lm-eval sorts them) and cut into fixed-shape batches
[B, T]: B the eval batch, its rows split over the batch axes as a training batch's are (each
process places its own rows); T the batch's longest row rounded up to a bucket (64, 128, 256, ...,
at most max_len). Padding rows and positions carry no targets. A task therefore compiles once per
bucket it reaches, never per example, and every later eval of the run reuses the programs. Batch
i + 1 is dispatched before batch i is fetched, so the device does not wait for the host.

A request's row is lm-eval's: (context + continuation)[-(max_len + 1):][:-1], right-padded (a
causal model's real tokens never see the padding after them); the continuation's tokens are the
targets of its last positions. Greedy continuations run models/decoding.py's KV-cache decode loop
on left-padded prompts in batches of the same B rows, prompts longer than max_len - max_new cut
from the left (as lm-eval cuts them), each row stopping at its first stop id (tokenizer.stop_ids).
"""

import collections
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from disttrain.data.global_arrays import Assembler
from disttrain.errors import DataError
from disttrain.models import decoding, lora, moe, preference
from disttrain.parallel.mesh import Parallelism
from disttrain.parallel.state import FROZEN

MIN_BUCKET = 64
TRACES = collections.Counter()  # 'score' / 'greedy' -> traces in this process (tests read it)
Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)
Progress = Callable[[int], None]  # called with the rows finished since the last call


def bucket(length: int, limit: int) -> int:
  """The padded length of a batch whose longest row is `length`: 64, 128, 256, ... <= limit."""
  size = MIN_BUCKET
  while size < length:
    size *= 2
  return min(size, limit)


def language_model(model) -> tuple[Any, bool]:
  """(the decoder the run trains, whether its parameters are LoRA adapters on a frozen base);
  (None, False) for a model that is not a language model."""
  while isinstance(model, preference.WithReference):  # DPO / GRPO: the policy, not its reference
    model = model.model
  if not hasattr(model, 'family'):
    return None, False
  adapters = isinstance(model, lora.LoraModel)
  return (model.adapted_model if adapters else model), adapters


def _fetch(x: jax.Array) -> np.ndarray:
  """The whole of a global array on every process."""
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class Scorer:
  """Log-likelihoods and greedy continuations in fixed-shape batches (module doc)."""

  def __init__(self, model, batch_sharding, batch_size: int, max_len: int,
               stops: tuple[int, ...]):
    lm, self.adapters = language_model(model)
    module = moe.dropless(lm.module)
    self.module, self.max_len, self.stops = module, max_len, tuple(stops)
    ways = Parallelism(batch_sharding.mesh).batch_ways
    self.rows = -(-batch_size // ways) * ways  # B: a whole number of rows per batch shard
    self.assemble = Assembler(batch_sharding, self.rows)
    self._score = jax.jit(self._forward)
    self._decoders = {}  # max_new -> the jitted decode loop

  def _params(self, params, mutable):
    return lora.join(mutable[FROZEN], params) if self.adapters else params

  def _forward(self, params, mutable, tokens_BxT, segments_BxT, targets_BxT):
    """(summed log-probability of the targets [B], every target the argmax [B])."""
    TRACES['score'] += 1
    logits_BxTxV = self.module.apply({'params': self._params(params, mutable)}, tokens_BxT, False,
                                     segment_ids=segments_BxT)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    counted_BxT = targets_BxT >= 0
    picked_BxT = jnp.take_along_axis(logp_BxTxV, jnp.maximum(targets_BxT, 0)[..., None],
                                     axis=-1)[..., 0]
    greedy_BxT = jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT
    return (jnp.where(counted_BxT, picked_BxT, 0.0).sum(axis=-1),
            jnp.all(greedy_BxT | ~counted_BxT, axis=-1))

  def _placed(self, arrays: dict) -> dict:
    """Global [B, ...] arrays on the batch sharding, from every row (this process's rows)."""
    return self.assemble({k: v[self.assemble.rows] for k, v in arrays.items()})

  def _batches(self, lengths: Sequence[int]):
    """Indices of the items in batches of B rows, longest first (ties in input order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for start in range(0, len(order), self.rows):
      yield order[start:start + self.rows]

  def loglikelihoods(self, params, mutable, requests: Sequence[Request],
                     progress: Progress = lambda n: None) -> list[tuple[float, bool]]:
    """(log-likelihood, is greedy) of each (context, continuation) request, in order."""
    longest = max((len(continuation) for _, continuation in requests), default=0)
    if longest > self.max_len:  # its first tokens would have no row to be scored in
      raise DataError(f'a continuation of {longest} tokens is longer than the {self.max_len} '
                      'tokens a scoring window holds; raise the window (--max_length, '
                      'data.seq_len) or drop the request\'s task')
    rows = [(list(context) + list(continuation))[-(self.max_len + 1):]
            for context, continuation in requests]
    out: list = [None] * len(requests)
    pending = None

    def collect(chosen, sums_B, greedy_B) -> None:
      sums, greedy = _fetch(sums_B), _fetch(greedy_B)
      for row, i in enumerate(chosen):
        out[i] = (float(sums[row]), bool(greedy[row]))
      progress(len(chosen))
    for chosen in self._batches([len(r) for r in rows]):
      t = bucket(max(len(rows[i]) - 1 for i in chosen), self.max_len)
      tokens, segments = np.zeros((2, self.rows, t), np.int32)
      targets = np.full((self.rows, t), -1, np.int32)
      for row, i in enumerate(chosen):
        inputs, n = rows[i][:-1], len(requests[i][1])
        tokens[row, :len(inputs)] = inputs
        segments[row, :len(inputs)] = 1
        targets[row, len(inputs) - n:len(inputs)] = rows[i][-n:] if n else []
      batch = self._placed({'tokens': tokens, 'segments': segments, 'targets': targets})
      result = self._score(params, mutable, batch['tokens'], batch['segments'], batch['targets'])
      if pending is not None:  # fetch one batch late: the next one is already running
        collect(*pending)
      pending = (chosen, *result)
    if pending is not None:
      collect(*pending)
    return out

  def _decoder(self, max_new: int):
    if max_new not in self._decoders:
      loop = decoding.decode_loop(self.module, max_new, self.stops, 0.0, 0, 1.0)

      def run(params, mutable, tokens_BxP, segments_BxP, positions_BxP):
        TRACES['greedy'] += 1
        return loop(self._params(params, mutable), tokens_BxP, segments_BxP, positions_BxP,
                    jax.random.key(0))[0]  # temperature 0: the key is never drawn from
      self._decoders[max_new] = jax.jit(run)
    return self._decoders[max_new]

  def greedy(self, params, mutable, prompts: Sequence[Sequence[int]], max_new: int,
             progress: Progress = lambda n: None) -> list[list[int]]:
    """The greedy continuation of each prompt (token ids), in order."""
    limit = self.max_len - max_new
    prompts = [list(p)[-limit:] for p in prompts]
    decode, out, pending = self._decoder(max_new), [None] * len(prompts), None

    def collect(chosen, new_BxN) -> None:
      new = _fetch(new_BxN)
      for row, i in enumerate(chosen):
        out[i] = [int(t) for t in decoding.until_stop(new[row], self.stops)]
      progress(len(chosen))
    for chosen in self._batches([len(p) for p in prompts]):
      p = bucket(len(prompts[chosen[0]]), limit)
      # Filler rows repeat the first prompt: they stop with it instead of running to max_new.
      rows = [prompts[i] for i in chosen] + [prompts[chosen[0]]] * (self.rows - len(chosen))
      tokens, segments, positions = decoding.left_padded(rows, p)
      batch = self._placed({'tokens': tokens, 'segments': segments, 'positions': positions})
      result = decode(params, mutable, batch['tokens'], batch['segments'], batch['positions'])
      if pending is not None:
        collect(*pending)
      pending = (chosen, result)
    if pending is not None:
      collect(*pending)
    return out

"""Gradient accumulation: a gradient function of one batch made the sum over M micro-batches,
one after another in a lax.scan, with the micro-batches laid out so slicing one never moves data
between devices, and fsdp's parameters gathered once before the loop (step.py's
accumulated_grads applies it to the loss; spmd.py builds the Gather)."""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp


def micro_batches(batch: dict, m: int) -> dict:
  """[B, ...] -> [M, B / M, ...], micro-batch i = rows i, i + M, i + 2M, ...

  Every device then holds an equal share of every micro-batch (its rows of the global batch are
  one block; reshaping that block puts B / (M devices) of them in each micro-batch), so slicing a
  micro-batch never moves data between devices, in jit and in shard_map alike.
  """
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 0, 1),
                      batch)


@dataclasses.dataclass(frozen=True)
class Gather:
  """fsdp under gradient accumulation (jit style): the parameters are made whole once, before
  the micro-batch loop, so the loop body gathers none; the gradient accumulator keeps the
  parameters' own (split) layout, so it costs no more memory than they do."""
  whole: Any  # NamedSharding per parameter, without the fsdp axis
  split: Any  # NamedSharding per parameter, as stored


def microbatched(grads_fn, m: int, gather: Gather | None = None):
  """A gradient function of one batch, `grads_fn(params, mutable, batch, rng, policy, share) ->
  (grads, sums, mutable)`, made the sum over M micro-batches, one after another (lax.scan).

  Gradients and sums accumulate in float32; dropout keys are fold_in(rng, i) for micro-batch i;
  mutable collections (BatchNorm statistics) are updated by each micro-batch in turn.
  """
  if m == 1:
    return grads_fn

  def accumulated(params, mutable, batch, rng, policy, share: float):  # step.Policy
    # Cast (then gather) once: d loss / d params equals the float32 cast of d loss / d cast(params).
    compute_params = policy.cast(params)
    if gather is not None:
      compute_params = jax.lax.with_sharding_constraint(compute_params, gather.whole)
    # The policy casts the model's inputs in each call (the parameters again: a no-op); the task
    # reads the batch uncast, as at M = 1 (bf16 targets or GRPO advantages would round).
    one = functools.partial(grads_fn, compute_params, policy=policy, share=share / m)

    def body(carry, xs):
      grads, sums, mutable = carry
      batch_i, i = xs
      g, s, mutable = one(mutable, batch_i, jax.random.fold_in(rng, i))
      add = lambda a, b: a + b.astype(jnp.float32)
      grads = jax.tree.map(add, grads, g)
      if gather is not None:
        grads = jax.lax.with_sharding_constraint(grads, gather.split)
      return (grads, jax.tree.map(add, sums, s), mutable), None

    micro = micro_batches(batch, m)
    shapes = jax.eval_shape(lambda: one(mutable, jax.tree.map(lambda x: x[0], micro), rng))
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)
    with jax.named_scope('micro_batches'):
      (grads, sums, mutable), _ = jax.lax.scan(
          body, (zeros(shapes[0]), zeros(shapes[1]), mutable), (micro, jnp.arange(m)))
    return grads, sums, mutable
  return accumulated

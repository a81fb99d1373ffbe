"""Pipeline stages: a stack of L layers split into S stages of L / S, on M micro-batches (GPipe).

  run(layer, params [L, ...], x [B, T, D], extras, mesh, axis, M) -> [B, T, D]

The stacked weights keep their un-pipelined layout [L, ...] with dimension 0 split over the
stage axis, so device group s holds layers s L/S .. (s+1) L/S - 1 and a checkpoint restores on
any S; inside the step they are viewed as [S, L/S, ...] (no data moves). Each of M + S - 1
iterations runs every stage at once (a vmap whose mapped dimension is the stage axis, so each
group computes only its own) and hands each stage's output to the next stage (a roll along the
stage axis: one collective permute). Stage s works on micro-batch t - s at iteration t, so
(S - 1) / (M + S - 1) of the work is bubble: stages idle at the start and end, computing on
zeros that nothing reads. The backward pass is JAX's own, through the same loop (GPipe keeps
every micro-batch's activations; a layer wrapped in jax.checkpoint recomputes its own).
MaxText's pipeline.py is the same design on the same GSPMD machinery.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def bubble_fraction(stages: int, micro_batches: int) -> float:
  """GPipe's idle share of a step: (S - 1) / (M + S - 1)."""
  return (stages - 1) / (micro_batches + stages - 1) if stages > 1 else 0.0


def _micro(x: jax.Array, m: int) -> jax.Array:
  """[B, ...] -> [M, B / M, ...], micro-batch i = rows i, i + M, ... (each device keeps an equal
  share of each: the layout of gradient accumulation's micro-batches)."""
  return jnp.swapaxes(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 0, 1)


def _unmicro(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def run(layer, params, x_BxTxD: jax.Array, extras: tuple, mesh, axis: str, batch_axes,
        micro_batches: int) -> jax.Array:
  """`layer(params of one layer, x [b, T, D], *extras [b, ...]) -> x` through every layer of
  `params` ([L, ...] leaves), pipelined over the mesh's `axis`; see the module docstring.
  `extras` (positions, segment ids; None allowed) travel with their micro-batch."""
  s, m = mesh.shape[axis], micro_batches
  num_layers = jax.tree.leaves(params)[0].shape[0]
  # Dimension 0 is split over the stage axis in S blocks: the view moves nothing, and the other
  # dimensions keep their own splits (tensor, fsdp).
  staged = jax.tree.map(lambda p: p.reshape((s, num_layers // s) + p.shape[1:]), params)
  x_MxbxTxD = _micro(x_BxTxD, m)
  extras_M = jax.tree.map(lambda e: _micro(e, m), extras)

  def stage(p_stage, h, ex):
    return jax.lax.scan(lambda h, p: (layer(p, h, *ex), None), h, p_stage)[0]
  # The mapped dimension is the stage axis: each device group computes its own stage only, and
  # the layers' activation constraints keep it split that way.
  stages = jax.vmap(stage, spmd_axis_name=axis)
  hold = lambda x: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P(axis, batch_axes, *([None] * (x.ndim - 2)))))

  def iteration(held, xs):
    fresh, t = xs
    # Stage 0 takes micro-batch t (zeros once they are all in); stage s takes what stage s - 1
    # made last iteration.
    inputs = hold(jnp.roll(held, 1, axis=0).at[0].set(fresh))
    which = jnp.clip(t - jnp.arange(s), 0, m - 1)  # each stage's micro-batch
    ex = jax.tree.map(lambda e: e[which], extras_M)
    held = hold(stages(staged, inputs, ex))
    return held, held[-1]  # the last stage's: micro-batch t - (S - 1) from t = S - 1 on

  feed = jnp.concatenate([x_MxbxTxD, jnp.zeros((s - 1,) + x_MxbxTxD.shape[1:], x_BxTxD.dtype)])
  zeros = jnp.zeros((s,) + x_MxbxTxD.shape[1:], x_BxTxD.dtype)
  _, lasts = jax.lax.scan(iteration, hold(zeros), (feed, jnp.arange(m + s - 1)))
  out = lasts[s - 1:]
  return _unmicro(out)

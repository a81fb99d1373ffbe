"""The memory pre-flight: compile the train-step variants the loop will call, say each one's
per-device memory, and refuse one that needs more than the device has, before the first step.

The batch-size finder (batch_size.py) holds each candidate to the same check on a Plan (setup.py:
the steps over abstract state); saved_activation_bytes is the backend-independent count of what
the forward pass keeps for the backward pass.
"""

from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from disttrain.config import Config
from disttrain.data import records as records_lib
from disttrain.data.batches import element_spec
from disttrain.data.global_arrays import stacked_sharding
from disttrain.errors import DisttrainError
from disttrain.parallel import step as step_lib
from disttrain.parallel.compiled import CompileInfo
from disttrain.parallel.step import Variant

if TYPE_CHECKING:  # what the checks read; setup.py builds them
  from disttrain.training.setup import Plan, Setup


class MemoryLimitError(DisttrainError):
  """A train step needs more memory per device than the device (or memory_limit_bytes) has."""

  def __init__(self, message: str, peak_bytes: int = 0):
    super().__init__(message)
    self.peak_bytes = peak_bytes  # what the step that did not fit needs per device


def train_batch_spec(run: 'Setup | Plan') -> dict:
  """The loop's train batch as ShapeDtypeStructs: [B, ...] (or [K, B, ...]) with shardings."""
  k = run.cfg.steps_per_dispatch
  spec = run.step_spec or element_spec(run.train_data)
  lead = (run.cfg.global_batch_size,) if k == 1 else (k, run.cfg.global_batch_size)
  sharding = stacked_sharding(run.batch_sharding, k)
  return {name: jax.ShapeDtypeStruct(lead + s.shape[1:], s.dtype, sharding=sharding)
          for name, s in spec.items() if name != records_lib.MASK}  # made in the step


def loop_variants(cfg: Config, first_step: int) -> list[Variant]:
  """The train-step variants the loop will call from first_step on."""
  k = cfg.steps_per_dispatch
  ends = range(first_step + k, cfg.num_train_steps + 1, k)
  logged = {s % cfg.log_every_steps == 0 or s == cfg.num_train_steps for s in ends}
  return [Variant(metrics=m, steps=k, full_batch=True) for m in sorted(logged, reverse=True)]


def memory_limit(cfg: Config, mesh: Mesh) -> int | None:
  """cfg.memory_limit_bytes, else what this process's devices report (accelerators), else None."""
  if cfg.memory_limit_bytes:
    return cfg.memory_limit_bytes
  device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
  try:
    stats = device.memory_stats()
  except jax.errors.JaxRuntimeError:  # not supported on this platform
    stats = None
  return int(stats['bytes_limit']) if stats and stats.get('bytes_limit') else None


def mib(n: int) -> str:
  """Bytes as MiB, or GiB from 1 GiB on."""
  return f'{n / 2**30:.2f} GiB' if n >= 2**30 else f'{n / 2**20:.1f} MiB'


def preflight(run: 'Setup | Plan', device_state: Any, variants: list[Variant],
              say: Callable[[str], None], limit: int | None = None
              ) -> tuple[dict[str, CompileInfo], int | None]:
  """Compiles `variants`, says their per-device memory, refuses one that exceeds the limit.

  `limit` defaults to memory_limit(run.cfg, run.mesh); the batch-size finder passes its own
  (the limit less a headroom) and runs this on a Plan, so both hold a step to the same check.
  """
  batch = train_batch_spec(run)
  given = limit is not None
  limit = limit if given else memory_limit(run.cfg, run.mesh)
  source = 'given' if given else 'memory_limit_bytes' if run.cfg.memory_limit_bytes else 'device'
  infos = {}
  for variant in variants:
    info = run.steps.compile(variant, device_state, batch)
    infos[variant.name] = info
    say(f'compiled train step {variant.name} in {info.compile_seconds:.1f}s; per device: '
        f'state {mib(info.state_bytes)}, arguments {mib(info.argument_bytes)}, outputs '
        f'{mib(info.output_bytes)} ({mib(info.alias_bytes)} in place of the state), '
        f'temporaries {mib(info.temp_bytes)}: needs {mib(info.peak_bytes)}'
        + (f' of {mib(limit)}' if limit else ''))
    if limit and info.peak_bytes > limit:
      raise MemoryLimitError(
          f'train step {variant.name} needs {mib(info.peak_bytes)} per device (state '
          f'{mib(info.state_bytes)}, temporaries {mib(info.temp_bytes)}) but the limit is '
          f'{mib(limit)} ({source}); '
          'split the state (sharding=fsdp with mesh.fsdp, mesh.tensor with logical_rules), '
          'recompute activations (model.remat=full), split the batch (grad_accum_steps=4) or '
          'use a smaller global_batch_size', info.peak_bytes)
  return infos, limit


def saved_activation_bytes(run: 'Setup') -> int:
  """Bytes the train step's forward pass keeps for its backward pass, over all devices: the
  residuals of jax.vjp of the loss of one micro-batch (the global batch / grad_accum_steps)
  under the precision policy, from shapes only. Unlike XLA's temp bytes this does not depend on
  the backend (XLA:CPU computes bf16 dots in float32)."""
  policy = step_lib.Policy(jnp.dtype(run.cfg.precision.compute_dtype))
  micro = run.cfg.global_batch_size // run.cfg.grad_accum_steps
  spec = run.step_spec or element_spec(run.train_data)  # [B, ...]: one step's, whatever K
  batch = {k: jax.ShapeDtypeStruct((micro,) + v.shape[1:], v.dtype)
           for k, v in spec.items() if k != records_lib.MASK}
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), run.state.params)
  mutable = run.state.mutable

  def loss(params, batch):
    outputs, _, _ = run.model.apply({'params': policy.cast(params), **mutable},
                                    policy.cast_batch(batch), train=True, rng=jax.random.key(0))
    return jnp.mean(run.task.per_example(outputs, step_lib.with_mask(batch))['loss'])
  vjp_fn = jax.eval_shape(lambda p, b: jax.vjp(lambda q: loss(q, b), p)[1], params, batch)
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(vjp_fn))

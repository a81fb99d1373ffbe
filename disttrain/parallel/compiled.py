"""One train entry with static options, backed by a cache of ahead-of-time compiled variants.

`Steps.train(state, batch, variant)` compiles each Variant once (jit(...).lower(...).compile()),
keeps the executable and what XLA says about it (compile seconds, per-device bytes of arguments,
outputs and temporaries), and calls it. The loop compiles the variants it will use before the
first step, from abstract shapes, so memory is known (and checked) before anything runs.
"""

import collections
import dataclasses
import math
import time
from typing import Any, Callable

import jax
import numpy as np

from disttrain.parallel.step import Metrics, Variant


@dataclasses.dataclass(frozen=True)
class CompileInfo:
  """One compiled train-step variant, per device (run.json: compiled -> variant name -> this)."""
  compile_seconds: float
  state_bytes: int  # the train state's shard on one device
  argument_bytes: int  # state + batch (+ anything else passed in)
  output_bytes: int
  alias_bytes: int  # outputs written in place of donated arguments (the state)
  temp_bytes: int  # activations and other temporaries
  generated_code_bytes: int

  @property
  def peak_bytes(self) -> int:
    """What the step needs at once: arguments, outputs not aliased to them, temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), 'peak_bytes': self.peak_bytes}


def abstract(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of arrays; ShapeDtypeStructs pass through."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=getattr(x, 'sharding', None)), tree)


def shard_bytes(tree: Any) -> int:
  """Bytes of one device's shard of every leaf (the largest shard where shards differ)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


@dataclasses.dataclass
class Steps:
  """Compiled train/eval steps of one style, plus conversions to the style's state form.

  make_train(variant) -> jitted (device state, batch) -> (device state, metrics); called once per
  variant. `custom`: a user train_step reports what it reports, so the metrics/full-batch options
  fold into one variant per steps-per-call.
  """
  make_train: Callable[[Variant], Any]
  evaluate: Callable[[Any, dict], Metrics]  # (canonical state, batch) -> sums incl. 'count'
  grads: Callable[[Any, dict], Any]  # (device state, batch) -> global-batch gradients
  place: Callable[[Any], Any]  # canonical state -> the style's device state
  export: Callable[[Any], Any]  # the style's device state -> canonical state
  traces: collections.Counter  # variant name -> traces (each must trace once)
  custom: bool = False
  compiled: dict = dataclasses.field(default_factory=dict)  # variant name -> CompileInfo
  _executables: dict = dataclasses.field(default_factory=dict)

  def canonical(self, variant: Variant) -> Variant:
    return Variant(steps=variant.steps) if self.custom else variant

  def compile(self, variant: Variant, state: Any, batch: Any) -> CompileInfo:
    """Compiles `variant` for these shapes (arrays or ShapeDtypeStructs) unless it already is."""
    variant = self.canonical(variant)
    if variant.name not in self.compiled:
      state, batch = abstract(state), abstract(batch)
      start = time.perf_counter()
      executable = self.make_train(variant).lower(state, batch).compile()
      seconds = time.perf_counter() - start
      memory = executable.memory_analysis()
      self._executables[variant.name] = executable
      self.compiled[variant.name] = CompileInfo(
          compile_seconds=round(seconds, 3), state_bytes=shard_bytes(state),
          argument_bytes=int(memory.argument_size_in_bytes),
          output_bytes=int(memory.output_size_in_bytes),
          alias_bytes=int(memory.alias_size_in_bytes),
          temp_bytes=int(memory.temp_size_in_bytes),
          generated_code_bytes=int(memory.generated_code_size_in_bytes))
    return self.compiled[variant.name]

  def train(self, state: Any, batch: dict, variant: Variant = Variant()) -> tuple[Any, Metrics]:
    """One call of `variant` (default: every metric, any batch, padded or not)."""
    variant = self.canonical(variant)
    if variant.name not in self._executables:
      self.compile(variant, state, batch)
    return self._executables[variant.name](state, batch)

  @property
  def trace_count(self) -> int:
    """The most traces of any one train variant: 1 when every variant used compiled once."""
    return max(self.traces.values(), default=0)

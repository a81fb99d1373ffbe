"""Plain-function adapter: `init(rng, x) -> params` and `apply(params, x) -> outputs` over a pytree.

The raw-JAX style of seed 004 part 1: no module library, the parameters are any pytree (lists of
(w, b) tuples, dicts, ...). Follows the protocol described in disttrain/models/linen.py.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from disttrain.errors import ConfigError
from disttrain.models.linen import InputKey, model_inputs


@dataclasses.dataclass(frozen=True)
class FunctionalModel:
  """Wraps `init_fn(rng, x) -> params` and `apply_fn(params, x) -> outputs` (x = batch[input_key]).

  With a tuple of input keys both functions take one positional input per key.

  `logical` is an optional tree of the params' structure whose leaves are tuples of logical axis
  names (or PartitionSpecs, or None for "no annotation"); config `logical_rules` map the names to
  mesh axes, exactly as for Flax `with_logical_partitioning` metadata. The function has no
  mutable state, no RNG and no model loss.
  """
  init_fn: Callable[[jax.Array, jax.Array], Any]
  apply_fn: Callable[[Any, jax.Array], jax.Array]
  logical: Any = None
  input_key: InputKey = 'image'

  def init(self, rng: jax.Array, batch: dict) -> dict:
    """{'params': init_fn(rng, x)}."""
    return {'params': self.init_fn(rng, *model_inputs(batch, self.input_key))}

  def apply(self, variables: dict, batch: dict, *, train: bool, rng: jax.Array | None):
    """(apply_fn(params, x), {}, 0.0): a plain function has no collections and no model loss."""
    del train, rng  # a pure function of params and input
    return (self.apply_fn(variables['params'], *model_inputs(batch, self.input_key)), {},
            jnp.float32(0.0))

  def logical_specs(self, batch: dict) -> dict | None:
    """{'params': PartitionSpecs of logical names} from `logical`, checked against the params."""
    if self.logical is None:
      return None
    abstract = jax.eval_shape(
        lambda b: self.init_fn(jax.random.key(0), *model_inputs(b, self.input_key)), batch)
    is_spec = lambda x: x is None or isinstance(x, (tuple, list)) and all(
        n is None or isinstance(n, str) for n in x)
    specs = jax.tree.map(lambda s: None if s is None else P(*s), self.logical, is_leaf=is_spec)
    want = jax.tree.structure(abstract)
    got = jax.tree.structure(specs, is_leaf=lambda x: x is None or isinstance(x, P))
    if want != got:
      raise ConfigError(f'logical specs have structure {got} but the params have {want}; give '
                        'one tuple of axis names (or None) per parameter array')
    return {'params': specs}

  def with_batch_axes(self, axes) -> 'FunctionalModel':
    """No cross-example statistics: the same function on any slice of the batch."""
    del axes
    return self

  def check_batch_axes(self, variables: dict) -> None:
    """Nothing to check: a plain function has no mutable collections."""
    del variables

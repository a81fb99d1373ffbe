"""The TrainState pytree and its creation directly sharded on the mesh.

eval_shape -> partition rules -> NamedSharding tree -> jit(init, out_shardings=...): parameters
and optimizer state are born on their devices, never assembled whole on one host.
"""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from disttrain.config import Config
from disttrain.parallel import sharding as sharding_lib
from disttrain.parallel.mesh import Parallelism


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training; a pytree, so it can be sharded and checkpointed."""
  # Field order is the order of the compiled step's arguments: the big optimizer state and the
  # parameters first, as in a hand-written step's (sorted) dict state.
  opt_state: Any
  params: Any
  mutable: Any  # non-parameter collections, e.g. {'batch_stats': ...}
  rng: jax.Array  # uint32 key data; dropout keys are fold_in(rng, step)
  step: jax.Array  # int32 scalar: number of updates applied


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a state is laid out on the mesh."""
  shardings: TrainState  # NamedSharding per leaf
  param_specs: Any  # PartitionSpec per parameter
  replicated: list[str]  # what fsdp left whole, and why


def _zeros(spec: dict) -> dict:
  """A batch of zeros with the spec's shapes and dtypes (inside init: shapes are all it needs)."""
  return {k: jnp.zeros(s.shape, s.dtype) for k, s in spec.items()}


# A mutable collection of this name holds frozen inputs (LoRA's base weights): laid out like
# parameters, never checkpointed (a run reloads them from their source; disttrain/models/lora.py).
FROZEN = 'frozen'


def init_variables(model, spec: dict, seed: int) -> dict:
  """The model's variables as a fresh state initialises them (call under jit or eval_shape)."""
  return model.init(jax.random.fold_in(jax.random.key(seed), 0), _zeros(spec))


def has_frozen(state) -> bool:
  """Whether a TrainState (or its abstract form) holds a frozen collection."""
  return isinstance(getattr(state, 'mutable', None), dict) and FROZEN in state.mutable


def saved_part(state):
  """The state without its frozen collection: what checkpoints hold."""
  if not has_frozen(state):
    return state
  return state.replace(mutable={k: v for k, v in state.mutable.items() if k != FROZEN})


def with_frozen(state, frozen):
  """A restored state with the frozen collection put back."""
  return state.replace(mutable={**state.mutable, FROZEN: frozen})


def _init_fn(model, tx: optax.GradientTransformation, spec: dict, seed: int):
  def init() -> TrainState:
    root = jax.random.key(seed)
    variables = init_variables(model, spec, seed)
    params = variables['params']
    mutable = {k: v for k, v in variables.items() if k != 'params'}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      mutable=mutable, rng=jax.random.key_data(jax.random.fold_in(root, 1)))
  return init


def params_specs(model, params, spec: dict, cfg: Config, mesh: Mesh) -> tuple[Any, list[str]]:
  """PartitionSpecs of the parameters (abstract `params`) by the config's rules, and what stayed
  whole."""
  logical = model.logical_specs(spec)
  return sharding_lib.specs_for(params, cfg, mesh,
                                logical=logical.get('params') if logical else None)


def abstract_params(model, spec: dict, cfg: Config, mesh: Mesh) -> Any:
  """The parameters' ShapeDtypeStructs with their shardings (no optimizer): for inference."""
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), _zeros(spec)))['params']
  specs, _ = params_specs(model, shapes, spec, cfg, mesh)
  return jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                        sharding=NamedSharding(mesh, p)),
                      shapes, specs, is_leaf=lambda x: isinstance(x, P))


def layout(model, tx, spec: dict, cfg: Config, mesh: Mesh, check: bool = True) -> Layout:
  """Shardings for every leaf of the state, derived from abstract shapes and the rules.

  `spec`: a one-example batch as jax.ShapeDtypeStructs (disttrain.data.element_spec). `check`:
  refuse a mesh.tensor that splits nothing (a run; reading a saved one lays out what it saved).
  """
  abstract = jax.eval_shape(_init_fn(model, tx, spec, cfg.seed))
  param_specs, replicated = params_specs(model, abstract.params, spec, cfg, mesh)
  rest = {k: v for k, v in abstract.mutable.items() if k != FROZEN}
  mutable_specs, _ = sharding_lib.specs_for(rest, cfg, mesh)
  if FROZEN in abstract.mutable:  # the frozen base is laid out as parameters: their paths (for
    # param_rules, which saw 'frozen/blocks/...') and their logical names
    logical = (model.logical_specs(spec) or {}).get(FROZEN)
    mutable_specs = {**mutable_specs, FROZEN: sharding_lib.specs_for(
        abstract.mutable[FROZEN], cfg, mesh, logical=logical)[0]}
  if check:
    Parallelism(mesh).check_splits(sharding_lib.split_summary(
        {'params': param_specs, **mutable_specs}, mesh)['axes'])
  replicate = NamedSharding(mesh, P())
  param_shardings = sharding_lib.named(mesh, param_specs)
  opt_shardings = _follow_params(abstract.opt_state, abstract.params, param_shardings, replicate)
  shardings = TrainState(step=replicate, params=param_shardings, opt_state=opt_shardings,
                         mutable=sharding_lib.named(mesh, mutable_specs), rng=replicate)
  return Layout(shardings=shardings, param_specs=param_specs, replicated=replicated)


def _follow_params(opt_state, params, param_shardings, replicate: NamedSharding):
  """Each optimizer-state leaf takes the sharding of its parameter; others replicate.

  Its parameter is the one whose path ends the leaf's path ('.../mu/Dense_0/kernel') with the
  same shape: this covers Adam-style moments, multi_transform's per-group states and custom
  transformations alike; counts and other scalars replicate.
  """
  by_path = {}
  for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                    jax.tree.leaves(param_shardings)):
    by_path[sharding_lib.path_str(path)] = (tuple(leaf.shape), sharding)

  def follow(path, leaf):
    parts = sharding_lib.path_str(path).split('/')
    for i in range(len(parts)):
      shape, sharding = by_path.get('/'.join(parts[i:]), (None, None))
      if shape == tuple(leaf.shape):
        return sharding
    return replicate
  return jax.tree_util.tree_map_with_path(follow, opt_state)


def create(model, tx, spec: dict, cfg: Config, mesh: Mesh) -> tuple[TrainState, Layout]:
  """A fresh state, each leaf created on its devices with its sharding."""
  lay = layout(model, tx, spec, cfg, mesh)
  sharding_lib.log_replicated(lay.replicated)
  state = jax.jit(_init_fn(model, tx, spec, cfg.seed), out_shardings=lay.shardings)()
  return state, lay


def abstract(lay: Layout, model, tx, spec: dict, seed: int) -> TrainState:
  """The state's ShapeDtypeStructs with their shardings, without creating anything."""
  shapes = jax.eval_shape(_init_fn(model, tx, spec, seed))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, lay.shardings)

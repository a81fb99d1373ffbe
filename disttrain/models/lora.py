"""Low-rank adapters (LoRA): y = x W + (alpha / r) dropout(x) A B on the projections a regex names.

The decoder's projections (layers.py) take an `Adapter` beside their kernel when `lora.targets`
matches the kernel's path ('blocks/attention/query/kernel'): A [in, r] starts uniform (PEFT's
Kaiming init), B [r, out] at zero, so step 0 is the base model. The adapter computes x A then B,
so no full-size weight gradient or merged copy is ever made; the frozen weights get no gradient.

`LoraModel` wraps such a model on disttrain's protocol: its 'params' are the adapters alone (what
the optimizer sees and the checkpoints keep) and the base weights are the FROZEN collection,
stored once (float32 or bfloat16), laid out like parameters, never saved (the run reloads them
from restore_from, or re-initialises them from the seed, on resume). `merge` gives the plain
model's parameters, W + (alpha / r) A B, for export, HF saves and sampling.
"""

import dataclasses
import math
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from disttrain.config import LORA_TARGETS, LoraConfig
from disttrain.errors import ConfigError
from disttrain.parallel import sharding as sharding_lib
from disttrain.parallel.state import FROZEN

SUFFIX = '_lora'  # an adapter's module name: the projection's name + SUFFIX, params 'a' and 'b'


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """The adapters of a run (config group `lora`)."""
  rank: int
  alpha: float
  dropout: float = 0.0
  targets: str = LORA_TARGETS

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def matches(self, kernel_path: str) -> bool:
    return re.search(self.targets, kernel_path) is not None


class Adapter(nn.Module):
  """(alpha / r) dropout(x) A B over the last `n_in` axes of x; A [in..., r], B [r, out...]."""
  spec: LoraSpec
  out_shape: tuple
  in_axes: tuple  # logical names of the input dims (A's sharding)
  out_axes: tuple  # logical names of the output dims (B's sharding)
  kernel_path: str
  dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    n_in, r = len(self.in_axes), self.spec.rank
    in_shape = x.shape[-n_in:]
    if r > min(math.prod(in_shape), math.prod(self.out_shape)):
      raise ConfigError(f'lora.rank={r} is larger than {self.kernel_path} '
                        f'{tuple(in_shape) + tuple(self.out_shape)} allows (its smaller side, '
                        f'{min(math.prod(in_shape), math.prod(self.out_shape))}); use a smaller '
                        'lora.rank or narrow lora.targets')
    bound = 1.0 / math.sqrt(math.prod(in_shape))  # PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in]
    uniform = lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound,
                                                                       bound)
    a = self.param('a', nn.with_logical_partitioning(uniform, self.in_axes + (None,)),
                   in_shape + (r,))
    b = self.param('b', nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                     (None,) + self.out_axes),
                   (r,) + tuple(self.out_shape))
    if self.spec.dropout and self.has_rng('dropout'):
      x = nn.Dropout(self.spec.dropout, deterministic=False)(x)
    h = jnp.tensordot(x.astype(self.dtype), a.astype(self.dtype), axes=n_in)
    # Scaled in float32, rounded once (as PEFT's bf16 tensor * float): alpha / r unrounded.
    out = jnp.tensordot(h, b.astype(self.dtype), axes=1)
    return (out.astype(jnp.float32) * self.spec.scale).astype(self.dtype)


def adapted(dense: nn.Module, spec: LoraSpec | None, kernel_path: str, out_shape: tuple,
            in_axes: tuple, out_axes: tuple, dtype):
  """`dense` (an nn.Dense / DenseGeneral being built) plus its adapter where `spec` targets it."""
  if spec is None or not spec.matches(kernel_path):
    return dense
  adapter = Adapter(spec, tuple(out_shape), tuple(in_axes), tuple(out_axes), kernel_path, dtype,
                    name=dense.name + SUFFIX)
  return lambda x: dense(x) + adapter(x).astype(dtype)


def _flat(tree) -> dict:
  return {sharding_lib.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nest(flat: dict) -> dict:
  out = {}
  for path, x in flat.items():
    node = out
    *parents, leaf = path.split('/')
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = x
  return out


def is_adapter(path: str) -> bool:
  parts = path.split('/')
  return len(parts) >= 2 and parts[-2].endswith(SUFFIX) and parts[-1] in ('a', 'b')


def split(params) -> tuple[dict, dict]:
  """(adapters, frozen base) of a tree holding both."""
  flat = _flat(params)
  return (_nest({p: x for p, x in flat.items() if is_adapter(p)}),
          _nest({p: x for p, x in flat.items() if not is_adapter(p)}))


def join(frozen, adapters) -> dict:
  """The one parameter tree the adapted module reads."""
  return _nest({**_flat(frozen), **_flat(adapters)})


def pairs(adapters) -> dict[str, tuple[Any, Any]]:
  """{kernel path: (A, B)} of an adapter tree."""
  flat = _flat(adapters)
  out = {}
  for path, a in flat.items():
    if path.endswith(SUFFIX + '/a'):
      module = path[:-len('/a')]
      out[module[:-len(SUFFIX)] + '/kernel'] = (a, flat[module + '/b'])
  return out


def delta(kernel_shape: tuple, a, b, scale: float):
  """(alpha / r) A B in the kernel's shape; A [lead..., in..., r], B [lead..., r, out...]."""
  lead = a.ndim + b.ndim - 2 - len(kernel_shape)
  n_in = a.ndim - lead - 1
  lead_shape = kernel_shape[:lead]
  a2 = a.reshape(lead_shape + (math.prod(a.shape[lead:lead + n_in]), a.shape[-1]))
  b2 = b.reshape(lead_shape + (b.shape[lead], math.prod(b.shape[lead + 1:])))
  return (jnp.matmul(a2.astype(jnp.float32), b2.astype(jnp.float32)) * scale).reshape(kernel_shape)


def merge(frozen, adapters, scale: float):
  """The plain model's parameters: each targeted kernel W + (alpha / r) A B, in float32."""
  flat = {p: jnp.asarray(x, jnp.float32) for p, x in _flat(frozen).items()}
  for path, (a, b) in pairs(adapters).items():
    flat[path] = flat[path] + delta(flat[path].shape, a, b, scale)
  return _nest(flat)


@dataclasses.dataclass(frozen=True)
class LoraModel:
  """A model whose adapters train and whose base is the frozen collection (see the module doc).
  Everything else (family, token counts, FLOPs, decoding) is the adapted model's."""
  adapted_model: Any  # built with the LoraSpec in its layers
  spec: LoraSpec
  base_dtype: Any = jnp.float32

  def __getattr__(self, name: str):
    if name.startswith('__'):
      raise AttributeError(name)
    return getattr(self.adapted_model, name)

  @property
  def dropout(self) -> float:
    """The model's dropout or the adapters' (either needs dropout keys in every layer)."""
    return max(getattr(self.adapted_model, 'dropout', 0.0), self.spec.dropout)

  def init(self, rng: jax.Array, batch: dict) -> dict:
    variables = dict(self.adapted_model.init(rng, batch))
    adapters, frozen = split(variables.pop('params'))
    if not adapters:
      raise ConfigError(f'lora.targets={self.spec.targets!r} matches no weight of this model; '
                        f'name some of {sorted(p for p in _flat(frozen) if p.endswith("kernel"))}')
    cast = lambda x: x.astype(self.base_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return {'params': adapters, FROZEN: jax.tree.map(cast, frozen), **variables}

  def apply(self, variables: dict, batch: dict, *, train: bool, rng):
    variables = dict(variables)
    frozen = variables.pop(FROZEN)
    variables['params'] = join(frozen, variables['params'])
    outputs, new_mutable, model_loss = self.adapted_model.apply(variables, batch, train=train,
                                                                rng=rng)
    if train:
      new_mutable = {**new_mutable, FROZEN: frozen}
    return outputs, new_mutable, model_loss

  def logical_specs(self, batch: dict) -> Any:
    specs = self.adapted_model.logical_specs(batch)
    if not specs or 'params' not in specs:
      return specs
    specs = dict(specs)
    leaf = lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec)  # None: no names
    flat = {sharding_lib.path_str(p): x for p, x in
            jax.tree_util.tree_flatten_with_path(specs.pop('params'), is_leaf=leaf)[0]}
    return {'params': _nest({p: s for p, s in flat.items() if is_adapter(p)}),
            FROZEN: _nest({p: s for p, s in flat.items() if not is_adapter(p)}), **specs}

  def with_batch_axes(self, axes) -> 'LoraModel':
    return dataclasses.replace(self, adapted_model=self.adapted_model.with_batch_axes(axes))

  def check_batch_axes(self, variables: dict) -> None:
    self.adapted_model.check_batch_axes({k: v for k, v in variables.items() if k != FROZEN})


def adapt(model, cfg: LoraConfig):
  """`model` with adapters where cfg.rank > 0 (a language model: its decoder takes them)."""
  if not cfg.rank:
    return model
  if not hasattr(model, 'family'):
    raise ConfigError(f'lora.rank={cfg.rank} adapts a language model\'s projections; '
                      f'{type(model).__name__} is not one (use a gpt, llama, qwen, mistral, '
                      'mixtral or gemma model, or lora.rank=0)')
  experts = getattr(model.module.cfg, 'num_experts', 0)
  if experts and jax.process_index() == 0:  # the default targets name MLPs it has none of
    print(f'lora: the {experts} experts and the router of each mixture-of-experts layer take no '
          'adapters and stay frozen; lora.targets adapts the attention projections',
          file=sys.stderr, flush=True)
  spec = LoraSpec(cfg.rank, cfg.alpha, cfg.dropout, cfg.targets)
  module = model.module.clone(cfg=dataclasses.replace(model.module.cfg, lora=spec))
  return LoraModel(dataclasses.replace(model, module=module), spec, jnp.dtype(cfg.base_dtype))

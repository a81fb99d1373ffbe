"""Direct preference optimization (DPO): a task over the same model, mesh and step.

A batch row is a pair [2, T] (chosen, rejected; data/preference.py). `WithReference` runs the
policy on the 2B sequences and the frozen reference on them too, under stop_gradient: the reference is
parameters, never a second model definition. With LoRA it is the base without the adapters (the
LoRA frozen collection, no second copy); otherwise it is the starting weights, kept once in the
frozen collection (loaded from restore_from, never checkpointed; parallel/state.py FROZEN).

`Dpo` takes each sequence's summed token log-probabilities over its loss mask (the policy's pi
and the reference's r) and gives per pair, as TRL's sigmoid DPO loss:
  chosen reward  = beta (pi_c - r_c),   rejected reward = beta (pi_r - r_r)
  loss           = -log sigmoid(chosen reward - rejected reward)
with `reward_margin` and `reward_accuracy` (chosen reward > rejected); the step averages them over
the global batch's pairs. The first step's loss is ln 2 (policy = reference).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from disttrain.models import chunked_loss, lora
from disttrain.parallel.state import FROZEN

PAIR_FIELDS = ('tokens', 'targets', 'loss_mask')


def flat_pairs(batch: dict) -> dict:
  """[B, 2, T] fields -> [2B, T] (chosen and rejected of a pair next to each other); arrays or
  ShapeDtypeStructs."""
  def flat(v):
    shape = (v.shape[0] * v.shape[1],) + tuple(v.shape[2:])
    return jax.ShapeDtypeStruct(shape, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else \
        v.reshape(shape)
  return {k: flat(v) for k, v in batch.items() if k in PAIR_FIELDS}


@dataclasses.dataclass(frozen=True)
class WithReference:
  """A language model (or its LoRA form) with the frozen reference's outputs beside its own, on
  pairs [B, 2, T] (DPO) or on plain rows (pairs=False: GRPO's KL penalty)."""
  model: Any
  pairs: bool = True

  def _rows(self, batch: dict) -> dict:
    return flat_pairs(batch) if self.pairs else batch

  def __getattr__(self, name: str):
    if name.startswith('__'):
      raise AttributeError(name)
    return getattr(self.model, name)

  @property
  def adapters(self) -> bool:
    return isinstance(self.model, lora.LoraModel)

  def init(self, rng: jax.Array, batch: dict) -> dict:
    variables = dict(self.model.init(rng, self._rows(batch)))
    if not self.adapters:  # the reference: the starting weights, kept once
      variables[FROZEN] = variables['params']
    return variables

  def apply(self, variables: dict, batch: dict, *, train: bool, rng):
    flat = self._rows(batch)
    variables = dict(variables)
    if self.adapters:
      policy_vars = variables
      reference_vars = {**variables, 'params': jax.tree.map(jnp.zeros_like, variables['params'])}
    else:
      reference = variables.pop(FROZEN)
      policy_vars, reference_vars = variables, {**variables, 'params': reference}
    outputs, new_mutable, model_loss = self.model.apply(policy_vars, flat, train=train, rng=rng)
    reference_out, _, _ = self.model.apply(jax.lax.stop_gradient(reference_vars), flat,
                                           train=False, rng=None)
    if train and not self.adapters:
      new_mutable = {**new_mutable, FROZEN: reference}
    return {'policy': outputs, 'reference': reference_out}, new_mutable, model_loss

  def logical_specs(self, batch: dict) -> Any:
    specs = self.model.logical_specs(self._rows(batch))
    if specs and not self.adapters:
      specs = {**specs, FROZEN: specs['params']}
    return specs

  def with_batch_axes(self, axes) -> 'WithReference':
    return dataclasses.replace(self, model=self.model.with_batch_axes(axes))

  def check_batch_axes(self, variables: dict) -> None:
    self.model.check_batch_axes({k: v for k, v in variables.items() if k != FROZEN})

  def tokens_per_example(self, spec: dict) -> int:
    return (2 if self.pairs else 1) * int(spec['tokens'].shape[-1])

  def flops_per_example(self, spec: dict, num_params: int, frozen_params: int = 0) -> float:
    if not self.pairs:  # the reference's forward pass: a third of a trained one
      return self.model.flops_per_example(spec, num_params, frozen_params) * 4 / 3
    one = {k: jax.ShapeDtypeStruct((v.shape[0],) + tuple(v.shape[2:]), v.dtype)
           for k, v in spec.items() if k in PAIR_FIELDS}
    # Two sequences trained, and the reference's forward pass (a third of a trained one) on both.
    return 2 * self.model.flops_per_example(one, num_params, frozen_params) * 4 / 3


def sequence_logps(outputs: Any, flat: dict) -> jax.Array:
  """[2B] summed log-probabilities of each sequence's counted targets."""
  if isinstance(outputs, dict):  # a mixture of experts: {'logits', 'moe_dropped'}
    outputs = outputs['logits']
  targets = flat['targets']
  weights = (targets >= 0).astype(jnp.float32)
  if 'loss_mask' in flat:
    weights = weights * (flat['loss_mask'] != 0)
  if isinstance(outputs, chunked_loss.Features):
    loss, _ = chunked_loss.sums(outputs, targets, weights, fused=False)  # rows weigh differently
    return -loss
  loss, _ = chunked_loss.token_values(outputs.astype(jnp.float32), targets, weights)
  return -loss.sum(-1)


@dataclasses.dataclass(frozen=True)
class Dpo:
  """The sigmoid DPO loss per pair (see the module docstring); dpo.beta."""
  beta: float = 0.1

  def per_example(self, outputs: dict, batch: dict) -> dict[str, jax.Array]:
    flat = flat_pairs(batch)
    policy = sequence_logps(outputs['policy'], flat).reshape(-1, 2)
    reference = sequence_logps(outputs['reference'], flat).reshape(-1, 2)
    chosen, rejected = (self.beta * (policy[:, k] - reference[:, k]) for k in (0, 1))
    margin = chosen - rejected
    return {'loss': -jax.nn.log_sigmoid(margin), 'reward_chosen': chosen,
            'reward_rejected': rejected, 'reward_margin': margin,
            'reward_accuracy': (margin > 0).astype(jnp.float32)}

"""GRPO's objective: a clipped policy gradient per completion token, token-weighted.

A batch row is a prompt and one sampled completion (training/rollout.py makes them): tokens,
next-token targets, a loss mask on the completion's tokens (its EOS included), positions and
segment ids (the prompt is left-padded), the row's group-normalized `advantages` [B] and, when
grpo.iterations > 1, `old_logprobs` [B, T] (the sampling policy's, computed before the batch's
first update). For each counted token t of row i, with logp the policy's log-probability of the
token at the sampling temperature:

  ratio  = exp(logp - old)       old = stop_gradient(logp) with one update per batch: ratio 1,
                                 gradient A_i grad logp
  loss_t = -min(ratio A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) A_i) + beta kl_t
  kl_t   = exp(ref - logp) - (ref - logp) - 1      (k3, to the frozen reference; beta > 0)

The step divides the sums by the global count of completion tokens (TRL's loss_type='dapo'), so a
step's loss does not depend on how completions fall over devices or micro-batches. Records add
`kl` and `clip_fraction` (tokens whose ratio left the region on the side that is clipped: below
when the advantage is negative, above when positive), token means like the loss.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from disttrain.data.records import MASK
from disttrain.models import chunked_loss

ROLLOUT_FIELDS = ('advantages', 'old_logprobs')


def _logits(outputs: Any) -> Any:
  """The logits (or chunked Features) of a model's outputs."""
  if isinstance(outputs, dict) and 'logits' in outputs:  # a mixture of experts
    return outputs['logits']
  return outputs


def _token_weights(batch: dict) -> jax.Array:
  """[B, T]: 1 for the completion's tokens (its EOS included), 0 for the prompt and padding."""
  return (batch['targets'] >= 0).astype(jnp.float32) * (batch['loss_mask'] != 0)


def token_logprobs(outputs: Any, batch: dict, temperature: float) -> tuple[jax.Array, jax.Array]:
  """(log-probabilities [B, T] of the targets at `temperature`, counted-token weights [B, T])."""
  weights = _token_weights(batch)
  return -chunked_loss.token_losses(_logits(outputs), batch['targets'], weights,
                                    temperature), weights


@dataclasses.dataclass(frozen=True)
class Grpo:
  """The clipped GRPO loss with an optional KL penalty (see the module docstring)."""
  epsilon: float = 0.2
  epsilon_high: float = 0.2
  beta: float = 0.0
  temperature: float = 1.0

  def weights(self, batch: dict) -> jax.Array:
    return _token_weights(batch).sum(-1) * batch[MASK]

  def per_example(self, outputs: Any, batch: dict) -> dict[str, jax.Array]:
    policy = _logits(outputs['policy'] if self.beta else outputs)
    weights = _token_weights(batch)
    per_token = {k: batch[k] for k in ('old_logprobs',) if k in batch}
    if self.beta:  # the frozen reference's: no gradient, computed once
      per_token['reference'] = token_logprobs(outputs['reference'], batch, self.temperature)[0]
    # Token by token, so a chunked loss makes each chunk's gradients while its logits exist.
    loss, (clip, kl) = chunked_loss.token_sums(
        policy, batch['targets'], weights, self._token_terms, per_token,
        {'advantages': batch['advantages'].astype(jnp.float32)}, self.temperature)
    return {'loss': loss, 'clip_fraction': clip, **({'kl': kl} if self.beta else {})}

  def _token_terms(self, logp, weights, per_token, per_row):
    """(weighted loss, (weighted out-of-region flags, weighted kl)) per token."""
    old = per_token.get('old_logprobs', jax.lax.stop_gradient(logp))
    advantage = per_row['advantages'][:, None]
    ratio = jnp.exp(logp - old)
    clipped = jnp.clip(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon_high)
    loss = -jnp.minimum(ratio * advantage, clipped * advantage)
    out_of_region = (((ratio < 1.0 - self.epsilon) & (advantage < 0))
                     | ((ratio > 1.0 + self.epsilon_high) & (advantage > 0)))
    kl = jnp.zeros_like(loss)
    if self.beta:
      log_ratio = per_token['reference'] - logp
      kl = jnp.exp(log_ratio) - log_ratio - 1.0
      loss = loss + self.beta * kl
    return loss * weights, (out_of_region * weights, kl * weights)

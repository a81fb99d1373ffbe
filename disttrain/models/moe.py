"""The mixture-of-experts feed-forward layer of the language models (model.num_experts > 0).

  router     float32 logits [B, T, E] = x W_r; each token picks its top k experts
             (model.experts_per_token), weighted by their softmax probabilities, renormalised
             over the k chosen (Mixtral) unless model.moe_norm_topk is off (Qwen3-MoE's
             norm_topk_prob=false)
  dispatch   per row, expert e takes at most C = ceil(model.expert_capacity x T k / E) token slots
             (at most T; capacity 0 = T: dropless), first choices before second choices, in
             position order (GShard, Switch); a choice beyond its expert's capacity is dropped
             (the token keeps its residual) and counted in records as `moe_dropped`
  experts    E feed-forward layers of the family's kind (SwiGLU or GELU, no biases) on
             [E, B, C, D], one batched matmul per weight
  combine    y[b, t] = sum over its kept choices of gate x expert output

Dispatch and combine are one-hot einsums, so the layer is plain XLA on any backend. Expert
weights name the logical axis 'experts', which the mesh's `expert` axis splits; tokens are split
over the batch axes (data, fsdp, expert) outside the layer and over (data, fsdp) x experts inside
it, so XLA turns the dispatch and combine into all-to-alls over `expert`.

Model losses (the task adds them; `losses` collection): the load-balancing loss E sum_e f_e p_e
(Switch; f_e the fraction of token choices routed to e, p_e the mean router probability of e;
per layer, summed over layers) times model.router_aux_weight, or with model.router_balance=
'transformers' transformers' form (`pooled_balance`: f and p over every layer's tokens, each of
the k choices counted, so about k at balance, not 1 a layer), and the router z-loss
mean(logsumexp(logits)^2) (ST-MoE), times model.router_z_weight; each over the whole batch of
the call: the same on any jit layout, but products of batch means, so a call on part of the
batch (a micro-batch of grad_accum_steps, a device's rows under shard_map or pmap) averages them
per part, a slightly different objective (docs/scaling.md). A packed row's padding tokens (segment
id 0, also every token of a packed eval batch's padding rows) route nowhere: they take no expert
slot and enter neither loss (transformers leaves attention_mask's padding out likewise); the
capacity stays a share of the whole row length T (a static shape). Rows without segment ids
count every token, the padding rows of a partly filled eval batch too.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from disttrain.models.layers import INIT, constrain, weights

MOE = 'moe'  # the collection of per-row dropped choices (read by LanguageModel)


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
  """Slots per expert per row: ceil(factor T k / E), at most T (a token picks an expert once)."""
  if factor <= 0:
    return tokens
  return min(tokens, max(1, math.ceil(factor * tokens * top_k / experts)))


def dropless(module):
  """The decoder module routing without a capacity (for scoring and generation): with one,
  padding and batch-mates take expert slots, so a request's result would depend on its batch."""
  if getattr(module.cfg, 'num_experts', 0) and module.cfg.expert_capacity:
    return module.clone(cfg=dataclasses.replace(module.cfg, expert_capacity=0.0))
  return module


def route(experts_BxTxK: jax.Array, gates_BxTxK: jax.Array, num_experts: int, slots: int,
          real_BxT: jax.Array | None = None):
  """(dispatch [B, T, E, C] 0/1, combine [B, T, E, C] gates, kept choices per row [B]).

  A row's choices queue for their expert in (choice rank, position) order; the first `slots`
  of each queue are kept. Padding (real_BxT 0) queues nowhere: it takes no real token's slot.
  """
  b, t, k = experts_BxTxK.shape
  chosen_BxTxKxE = jax.nn.one_hot(experts_BxTxK, num_experts, dtype=jnp.int32)
  if real_BxT is not None:
    chosen_BxTxKxE = chosen_BxTxKxE * real_BxT[:, :, None, None].astype(jnp.int32)
  queue = chosen_BxTxKxE.transpose(0, 2, 1, 3).reshape(b, k * t, num_experts)
  position = (jnp.cumsum(queue, axis=1) - 1).reshape(b, k, t, num_experts).transpose(0, 2, 1, 3)
  kept_BxTxKxE = chosen_BxTxKxE * (position < slots)
  slot_BxTxKxExC = jax.nn.one_hot(position, slots, dtype=jnp.float32) * kept_BxTxKxE[..., None]
  dispatch = slot_BxTxKxExC.sum(2)
  combine = (slot_BxTxKxExC * gates_BxTxK[..., None, None].astype(jnp.float32)).sum(2)
  return dispatch, combine, kept_BxTxKxE.sum((1, 2, 3))


def token_mean(values_BxTx_: jax.Array, real_BxT: jax.Array | None) -> jax.Array:
  """The mean over the tokens [B, T] (the real ones: real_BxT 1, padding 0) of per-token values."""
  if real_BxT is None:
    return values_BxTx_.mean((0, 1))
  real = real_BxT.reshape(real_BxT.shape + (1,) * (values_BxTx_.ndim - 2)).astype(jnp.float32)
  return (values_BxTx_ * real).sum((0, 1)) / jnp.maximum(real.sum((0, 1)), 1.0)


def switch_balance(probs_BxTxE: jax.Array, experts_BxTxK: jax.Array,
                   real_BxT: jax.Array | None = None) -> jax.Array:
  """The Switch load-balancing loss E sum_e f_e p_e over this layer's (real) tokens."""
  e, k = probs_BxTxE.shape[-1], experts_BxTxK.shape[-1]
  fraction = token_mean(jax.nn.one_hot(experts_BxTxK, e).sum(2), real_BxT) / k
  return e * jnp.sum(fraction * token_mean(probs_BxTxE, real_BxT))


def z_loss(logits_BxTxE: jax.Array, real_BxT: jax.Array | None = None) -> jax.Array:
  """The router z-loss: mean logsumexp^2 over the (real) tokens."""
  return token_mean(jax.nn.logsumexp(logits_BxTxE, axis=-1) ** 2, real_BxT)


def pooled_balance(choices_LxKxE: jax.Array, probs_LxE: jax.Array) -> jax.Array:
  """transformers' load_balancing_loss_func: E sum_{k,e} f_ke p_e with f (the fraction of
  tokens whose k-th choice is e) and p (e's mean router probability) over every layer's tokens."""
  return choices_LxKxE.shape[-1] * jnp.sum(choices_LxKxE.mean(0) * probs_LxE.mean(0)[None])


class MoeMlp(nn.Module):
  """Top-k routed experts in place of the dense MLP; see the module docstring."""
  num_experts: int
  top_k: int
  capacity_factor: float
  kind: str  # 'gelu' or 'swiglu'
  hidden: int
  dtype: Any
  aux_weight: float
  z_weight: float
  norm_topk: bool = True  # gates of the k chosen sum to 1 (Mixtral); False: their softmax shares
  balance: str = 'switch'  # or 'transformers': the statistics sown, the loss taken over layers

  def _experts(self, name: str, shape: tuple, axes: tuple) -> jax.Array:
    return self.param(name, weights(('experts',) + axes, INIT), (self.num_experts,) + shape)

  @nn.compact
  def __call__(self, x_BxTxD: jax.Array, real_BxT: jax.Array | None = None) -> jax.Array:
    """`real_BxT`: 1 for tokens, 0 for a packed row's padding (segment id 0), which takes no
    expert slot and enters neither router loss nor the dropped count (transformers' balancing
    loss leaves out attention_mask's padding likewise); None: every token is real."""
    _, t, d = x_BxTxD.shape
    e, k, f = self.num_experts, self.top_k, self.hidden
    logits_BxTxE = nn.Dense(e, use_bias=False, dtype=jnp.float32, name='router',
                            kernel_init=weights(('embed', None)))(x_BxTxD.astype(jnp.float32))
    # A stable sort, not lax.top_k: GSPMD gathers top_k's operand over the batch (jax 0.12).
    experts_BxTxK = jnp.argsort(-logits_BxTxE, axis=-1)[..., :k]
    # As transformers: the softmax over all E, the k chosen taken (renormalised to sum to 1
    # with norm_topk, which is the softmax over the k chosen logits).
    probs_BxTxE = jax.nn.softmax(logits_BxTxE, axis=-1)
    gates_BxTxK = jnp.take_along_axis(probs_BxTxE, experts_BxTxK, axis=-1)
    if self.norm_topk:
      gates_BxTxK = gates_BxTxK / gates_BxTxK.sum(-1, keepdims=True)
    if self.balance == 'transformers':  # LanguageModel pools them over the layers
      self.sow(MOE, 'choices', token_mean(jax.nn.one_hot(experts_BxTxK, e), real_BxT))
      self.sow(MOE, 'probs', token_mean(probs_BxTxE, real_BxT))
    else:
      self.sow('losses', 'router_balance',
               self.aux_weight * switch_balance(probs_BxTxE, experts_BxTxK, real_BxT))
    self.sow('losses', 'router_z', self.z_weight * z_loss(logits_BxTxE, real_BxT))
    slots = capacity(t, e, k, self.capacity_factor)
    dispatch, combine, kept_B = route(experts_BxTxK, gates_BxTxK, e, slots, real_BxT)
    tokens_B = t if real_BxT is None else real_BxT.astype(jnp.float32).sum(1)
    self.sow(MOE, 'dropped', (tokens_B * k - kept_B) / k)  # tokens' worth of dropped choices
    # Dispatched where the tokens are (rows split over every batch axis), then resharded to
    # experts over the expert axis: one all-to-all each way (XLA otherwise gathers all tokens).
    x_ExBxCxD = constrain(jnp.einsum('btec,btd->ebcd', dispatch.astype(self.dtype), x_BxTxD),
                          (None, 'batch', None, None))
    x_ExBxCxD = constrain(x_ExBxCxD, ('experts', 'batch', None, None))
    if self.kind == 'swiglu':
      gate = self._experts('gate', (d, f), ('embed', 'mlp')).astype(self.dtype)
      up = self._experts('up', (d, f), ('embed', 'mlp')).astype(self.dtype)
      h_ExBxCxF = (nn.silu(jnp.einsum('ebcd,edf->ebcf', x_ExBxCxD, gate))
                   * jnp.einsum('ebcd,edf->ebcf', x_ExBxCxD, up))
      down = self._experts('down', (f, d), ('mlp', 'embed')).astype(self.dtype)
    else:
      w_in = self._experts('mlp_in', (d, f), ('embed', 'mlp')).astype(self.dtype)
      h_ExBxCxF = nn.gelu(jnp.einsum('ebcd,edf->ebcf', x_ExBxCxD, w_in))
      down = self._experts('mlp_out', (f, d), ('mlp', 'embed')).astype(self.dtype)
    h_ExBxCxF = constrain(h_ExBxCxF, ('experts', 'batch', None, 'mlp'))
    y_ExBxCxD = constrain(jnp.einsum('ebcf,efd->ebcd', h_ExBxCxF, down),
                          ('experts', 'batch', None, None))
    y_ExBxCxD = constrain(y_ExBxCxD, (None, 'batch', None, None))
    return jnp.einsum('btec,ebcd->btd', combine.astype(self.dtype), y_ExBxCxD)

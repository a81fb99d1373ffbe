"""LanguageModel: a decoder (decoder.py) on disttrain's model protocol. It reads `tokens` and, in
packed rows, `positions` and `segment_ids`; reports router losses and dropped expert choices apart
from the loss; and counts tokens and model FLOPs for the train records' tokens/s and MFU.
"""

import dataclasses
from typing import Any

import jax
from flax import traverse_util

from disttrain.models import chunked_loss, moe
from disttrain.models.decoder import DecoderConfig
from disttrain.models.linen import LinenModel, model_inputs


# Batch fields a language model reads besides its tokens, when the data has them (packed rows).
PACKED_FIELDS = ('positions', 'segment_ids')


@dataclasses.dataclass(frozen=True)
class LanguageModel(LinenModel):
  """A decoder on disttrain's protocol: reads `tokens` (and `positions`, `segment_ids` of packed
  rows), counts tokens and model FLOPs (the tokens/s and MFU of train records).

  FLOPs per token: 6 N + 12 L T D (PaLM's and nanoGPT's count: forward and backward of every
  weight matmul, plus attention's two T-long matmuls per layer, D = heads x head size), where N
  excludes the parameters only looked up (positions; the token embedding unless tied) and, with
  experts, those of the E - k experts a token does not run.
  """
  input_key: Any = 'tokens'
  family: str = ''  # gpt, llama, qwen2, qwen3, mistral, mixtral, qwen3_moe: its HF layout
  splits_sequence = True  # mesh.context may split its positions (attention gathers K/V)
  pipelines = True  # mesh.stage may split its layers (disttrain/models/pipeline.py)

  @property
  def cfg(self) -> DecoderConfig:
    return self.module.cfg

  @property
  def num_experts(self) -> int:
    return self.cfg.num_experts

  @property
  def model_loss_name(self) -> str | None:
    """Router losses are reported as `router_loss`, apart from the language-model `loss`."""
    return 'router_loss' if self.cfg.num_experts else None

  @property
  def num_layers(self) -> int:
    return self.cfg.num_layers

  @property
  def dropout(self) -> float:
    return self.cfg.dropout

  def init(self, rng: jax.Array, batch: dict) -> dict:
    variables = super().init(rng, batch)
    variables.pop(moe.MOE, None)  # values of one call, not state
    return variables

  def apply(self, variables: dict, batch: dict, *, train: bool, rng: jax.Array | None):
    """Logits; with experts {'logits', 'moe_dropped': [B] dropped choices per row in tokens,
    the mean over layers}, which NextToken reports beside the loss."""
    if not self.cfg.num_experts:
      return super().apply(variables, batch, train=train, rng=rng)
    outputs, new_mutable, model_loss = super().apply(variables, batch, train=train, rng=rng,
                                                     sown=(moe.MOE,))
    sown = {k[-1]: v[0] for k, v in traverse_util.flatten_dict(new_mutable.pop(moe.MOE)).items()}
    if self.cfg.router_balance == 'transformers':  # pooled over the layers: [L, k, E], [L, E]
      model_loss += self.cfg.router_aux_weight * moe.pooled_balance(sown['choices'],
                                                                    sown['probs'])
    return ({'logits': outputs, 'moe_dropped': sown['dropped'].mean(0)}, new_mutable,
            model_loss)

  def inputs(self, batch: dict) -> tuple[tuple, dict]:
    packed = {k: batch[k] for k in PACKED_FIELDS if k in batch}
    return model_inputs(batch, self.input_key), {**packed, 'features': True}

  def loss_info(self, spec: dict) -> dict:
    """run.json's `loss`: whether the cross-entropy is chunked (chunked_loss.describe)."""
    cfg = self.cfg
    return chunked_loss.describe(cfg.loss_chunk, self.tokens_per_example(spec), cfg.padded_vocab)

  def tokens_per_example(self, spec: dict) -> int:
    (tokens,) = model_inputs(spec, self.input_key)
    return int(tokens.shape[1])

  def flops_per_example(self, spec: dict, num_params: int, frozen_params: int = 0) -> float:
    """6 per token and weight it runs through (2 forward, 4 backward), 4 for the frozen ones
    (LoRA's base: no weight gradients), and attention's 12 L T width per token."""
    cfg = self.cfg
    t = self.tokens_per_example(spec)
    lookups = cfg.learned_positions * cfg.width
    if not cfg.tied_embeddings:
      lookups += cfg.padded_vocab * cfg.width
    if cfg.num_experts:  # a token runs k of the E experts: the others' weights are not its FLOPs
      per_expert = (3 if cfg.mlp == 'swiglu' else 2) * cfg.width * cfg.mlp_dim
      lookups += (cfg.num_experts - cfg.experts_per_token) * per_expert * cfg.num_layers
    attended = cfg.num_heads * cfg.head_dim  # the width, unless head_dim is set apart from it
    # Positions each layer's queries see: a sliding window's, at most (MaxText's count).
    windows = cfg.layer_windows or (cfg.sliding_window,) * cfg.num_layers
    seen = sum(min(w, t) if w else t for w in windows)
    frozen = max(frozen_params - lookups, 0)  # the lookups are in a frozen base when there is one
    return float(t * (6 * (num_params - lookups) - 2 * frozen + 12 * seen * attended))

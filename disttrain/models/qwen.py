"""The Qwen families: Llama's decoder (disttrain/models/llama.py) with one change each.

  qwen2  Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): biases on the query, key and value projections
         (the output projection and the MLP have none).
  qwen3  Qwen3 (`Qwen3ForCausalLM`): RMSNorm over each head's queries and keys (a [head_dim]
         scale per layer, model.norm_eps), applied before the rotary embedding; `model.head_dim`
         is set apart from the width in the published sizes (128 for hidden 1,024 and 16 heads).
  qwen3_moe  Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 with every feed-forward layer a routed
         MoE layer (disttrain/models/moe.py; experts of moe_intermediate_size = model.mlp_dim,
         gates renormalised when norm_topk_prob = model.moe_norm_topk), dropless on import as
         mixtral.py says; a config.json with dense layers among them (decoder_sparse_step > 1,
         mlp_only_layers) is refused.

Both read the Llama fields (num_kv_heads, rope_theta, norm_eps, tied_embeddings, head_dim);
sliding-window attention (config.json use_sliding_window) is not built, and importing a model
that turns it on is refused. disttrain/hf/weights.py maps their weights, disttrain/hf/config.py
their config.json.
"""

import dataclasses

from disttrain.config import ModelConfig
from disttrain.models import llama, mixtral
from disttrain.models.decoder import Decoder
from disttrain.models.language_model import LanguageModel
from disttrain.models.hf_names import llama_layout

# family -> the DecoderConfig fields that make Llama's decoder that family's.
CHANGES = {'qwen2': {'qkv_bias': True}, 'qwen3': {'qk_norm': True},
           'qwen3_moe': {'qk_norm': True}}


def build_family(family: str):
  def build(cfg: ModelConfig, dtype, context: int) -> LanguageModel:
    if family == 'qwen3_moe':
      mixtral.require_experts(cfg, family, 'Qwen3-30B-A3B: 128 experts, 8 per token')
    decoder = dataclasses.replace(llama.decoder_config(cfg, dtype, context), **CHANGES[family])
    return LanguageModel(Decoder(decoder), family=family)
  return build


HF_NAMES = {'qwen2': llama_layout(qkv_bias=True), 'qwen3': llama_layout(qk_norm=True),
            'qwen3_moe': llama_layout(qk_norm=True, experts=(
                'mlp', ('gate_proj', 'up_proj', 'down_proj')))}

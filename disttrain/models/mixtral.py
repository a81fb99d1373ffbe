"""The Mixtral family (`MixtralForCausalLM`): Mistral's decoder (disttrain/models/mistral.py,
sliding window where config.json sets one) with every feed-forward layer a routed MoE layer
(disttrain/models/moe.py): `model.num_experts` SwiGLU experts of width `model.mlp_dim`,
`model.experts_per_token` per token, gates renormalised over the k chosen (Mixtral 8x7B: 8
experts, 2 per token; launch/configs/mixtral.py's mixtral_8x7b).

An imported model routes as transformers does, dropless (model.expert_capacity=0 from
config.json): every token reaches its k experts, so the logits match; a capacity set by the
user drops choices beyond it and reports them as `moe_dropped`. Qwen3-MoE is in qwen.py; the
experts' Hugging Face names below (HF_NAMES), config.json in disttrain/hf/config.py.
"""

from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.models import llama
from disttrain.models.decoder import Decoder
from disttrain.models.language_model import LanguageModel
from disttrain.models.hf_names import llama_layout


def require_experts(cfg: ModelConfig, family: str, example: str) -> None:
  if not cfg.num_experts:
    raise ConfigError(f'model.name={family!r} is a mixture of experts: set model.num_experts '
                      f'and model.experts_per_token ({example})')


def build(cfg: ModelConfig, dtype, context: int) -> LanguageModel:
  require_experts(cfg, 'mixtral', 'Mixtral 8x7B: 8 experts, 2 per token')
  return LanguageModel(Decoder(llama.decoder_config(cfg, dtype, context)), family='mixtral')


# Mistral's names, the experts under block_sparse_moe: w1 (gate), w3 (up), w2 (down).
HF_NAMES = {'mixtral': llama_layout(experts=('block_sparse_moe', ('w1', 'w3', 'w2')))}

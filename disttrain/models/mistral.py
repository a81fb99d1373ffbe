"""The Mistral family (`MistralForCausalLM`): Llama's decoder (disttrain/models/llama.py), its
weights under the same Hugging Face names, with sliding-window attention where config.json sets
one (`sliding_window`, e.g. 4,096 in Mistral 7B v0.1; null from v0.2 on): each token attends to
the last `model.sliding_window` positions, itself included, in training, under the context split
and while decoding from the KV cache (disttrain/models/attention.py). The published 7B shape is
launch/configs/mistral.py's mistral_7b.
"""

from disttrain.config import ModelConfig
from disttrain.models import llama
from disttrain.models.decoder import Decoder
from disttrain.models.language_model import LanguageModel
from disttrain.models.hf_names import llama_layout


def build(cfg: ModelConfig, dtype, context: int) -> LanguageModel:
  return LanguageModel(Decoder(llama.decoder_config(cfg, dtype, context)), family='mistral')


HF_NAMES = {'mistral': llama_layout()}  # Llama's names

"""The Hugging Face architectures disttrain maps, and what each family's config.json may leave out.

`LlamaForCausalLM` is disttrain's llama family, `Qwen2ForCausalLM` / `Qwen3ForCausalLM` its qwen2
and qwen3 families, `MistralForCausalLM` its mistral family (all with Llama's config.json keys),
`MixtralForCausalLM` / `Qwen3MoeForCausalLM` its mixtral and qwen3_moe families (their experts'
keys too; imported dropless, model.expert_capacity=0), `Gemma2ForCausalLM` / `Gemma3ForCausalLM`
its gemma2 and gemma3 families (hf/gemma_config.py), `GPT2LMHeadModel` its gpt family.
"""

from disttrain.errors import CheckpointError

ARCHITECTURES = {'LlamaForCausalLM': 'llama', 'Qwen2ForCausalLM': 'qwen2',
                 'Qwen3ForCausalLM': 'qwen3', 'MistralForCausalLM': 'mistral',
                 'MixtralForCausalLM': 'mixtral', 'Qwen3MoeForCausalLM': 'qwen3_moe',
                 'Gemma2ForCausalLM': 'gemma2', 'Gemma3ForCausalLM': 'gemma3',
                 'GPT2LMHeadModel': 'gpt'}
FAMILIES = {family: arch for arch, family in ARCHITECTURES.items()}
GEMMA = ('gemma2', 'gemma3')
GEMMA_TYPES = {'gemma2': 'gemma2', 'gemma3': 'gemma3_text'}  # model_type in config.json
# config.json's model_type, which from_pretrained's auto classes choose by, per family.
MODEL_TYPES = {**{f: f for f in FAMILIES}, **GEMMA_TYPES, 'gpt': 'gpt2'}
MOE = ('mixtral', 'qwen3_moe')  # every feed-forward layer routed experts
# What each rotary family's config.json must say (its transformers default when absent): the
# parts the family builds in one way only.
FIXED = {'llama': {'hidden_act': 'silu', 'attention_bias': False, 'mlp_bias': False},
         'qwen2': {'hidden_act': 'silu', 'use_sliding_window': False},
         'qwen3': {'hidden_act': 'silu', 'attention_bias': False, 'use_sliding_window': False},
         'mistral': {'hidden_act': 'silu'}, 'mixtral': {'hidden_act': 'silu'},
         'qwen3_moe': {'hidden_act': 'silu', 'attention_bias': False, 'use_sliding_window': False,
                       'decoder_sparse_step': 1, 'mlp_only_layers': []},
         'gemma2': {'hidden_activation': 'gelu_pytorch_tanh', 'attention_bias': False},
         'gemma3': {'hidden_activation': 'gelu_pytorch_tanh', 'attention_bias': False,
                    'use_bidirectional_attention': False}}
# transformers' config-class defaults for keys a config.json may leave out, where a family's
# differ from the common ones (rms_norm_eps 1e-6, rope_theta 1e4, no window, no caps).
DEFAULTS = {'mixtral': {'rms_norm_eps': 1e-5, 'rope_theta': 1e6},
            'mistral': {'sliding_window': 4096},
            'gemma2': {'sliding_window': 4096, 'attn_logit_softcapping': 50.0,
                       'final_logit_softcapping': 30.0},
            'gemma3': {'sliding_window': 4096, 'rope_theta': 1e6}}


def resolved(config: dict, family: str, key: str, common=None):
  """config.json's value of `key`, else the family's transformers default (null stays None)."""
  return config.get(key, DEFAULTS.get(family, {}).get(key, common))


def mismatch(where: str, hf_field: str, hf_value, ours: str, value) -> CheckpointError:
  """One line naming config.json's value, the run's, and the flag that fixes the run."""
  return CheckpointError(f'{where}: config.json {hf_field}={hf_value!r} but {ours}={value!r}; set '
                         f'--config.{ours}={hf_value!r} (or use a config of that model)')


def window(config: dict, family: str) -> int:
  """The attention window, 0 where no layer has one (a Gemma whose layer_types are all
  full_attention: transformers needs a sliding_window there all the same)."""
  if family not in ('mistral', 'mixtral', *GEMMA):
    return 0
  types = config.get('layer_types')
  if family in GEMMA and types and all(t == 'full_attention' for t in types):
    return 0
  return resolved(config, family, 'sliding_window') or 0

"""Model front ends behind one protocol, and the models that configs name.

Front ends (the protocol is described in linen.py): LinenModel (Flax Linen), NNXModel (Flax
NNX; flax.nnx is imported on first use), FunctionalModel (plain init/apply functions over a
params pytree) and KerasModel (Keras 3, an optional extra: `from disttrain.models.keras import
KerasModel`, imported on demand so that disttrain runs without keras installed). Language
models (gpt, llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, gemma2, gemma3) are
language_model.LanguageModel over one decoder; their task is NextToken.
"""

import dataclasses
import sys
from typing import Any, Callable

import jax.numpy as jnp

from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.models import gemma, gpt, llama, mistral, mixtral, qwen
from disttrain.models.functional import FunctionalModel
from disttrain.models.language_model import LanguageModel
from disttrain.models.linen import LinenModel
from disttrain.models.mlp import BobbinMLP, JAX_MLP_LOGICAL, MnistMLP, jax_mlp_apply, jax_mlp_init
from disttrain.models.task import Classification, NextToken


def __getattr__(name: str):
  if name == 'NNXModel':  # flax.nnx is imported when an NNX model is used
    from disttrain.models.nnx import NNXModel  # pylint: disable=g-import-not-at-top
    return NNXModel
  raise AttributeError(f'module disttrain.models has no attribute {name!r}')


# Builders take the model config, the compute dtype and the context length; the MLPs compute in
# whatever dtype the step's precision policy casts their parameters and inputs to.
def _mnist_mlp(cfg: ModelConfig, *_) -> LinenModel:
  return LinenModel(MnistMLP(num_classes=cfg.num_classes, hidden=cfg.hidden, dropout=cfg.dropout))


def _bobbin_mlp(cfg: ModelConfig, *_) -> LinenModel:
  return LinenModel(BobbinMLP(num_classes=cfg.num_classes, hidden=cfg.hidden,
                              dropout=cfg.dropout))


def _nnx_mlp(cfg: ModelConfig, *_):
  from disttrain.models.nnx import NNXModel  # pylint: disable=g-import-not-at-top
  from disttrain.models.nnx_mlp import NnxMLP  # pylint: disable=g-import-not-at-top
  return NNXModel(lambda rngs, input_shape: NnxMLP(input_shape, cfg.num_classes, cfg.hidden,
                                                   cfg.dropout, rngs=rngs))


def _jax_mlp(cfg: ModelConfig, *_) -> FunctionalModel:
  return FunctionalModel(lambda rng, x: jax_mlp_init(rng, x, cfg.hidden, cfg.num_classes),
                         jax_mlp_apply, logical=JAX_MLP_LOGICAL)


def _keras_mlp(cfg: ModelConfig, *_):
  try:
    from disttrain.models import keras_mlp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f"model.name='keras_mlp' needs keras ({e}); pip install '.[keras]'") from e
  return keras_mlp.model(cfg.num_classes, cfg.hidden)


def _char_lm(cfg: ModelConfig, dtype, context: int):
  print("warning: model.name='char_lm' is deprecated; it is the GPT (model.name='gpt') at "
        "launch/configs/char_lm.py's size", file=sys.stderr, flush=True)
  return gpt.build(cfg, dtype, context)


@dataclasses.dataclass(frozen=True)
class Entry:
  """How a config builds a model, and which batch fields it reads and learns by default."""
  build: Callable[..., Any]  # (model config, compute dtype, context length) -> model
  input_key: str
  target_key: str
  task: Callable[[str], Any] = lambda key: Classification(label_key=key)  # target key -> task


_IMAGE, _LM = ('image', 'label'), ('tokens', 'targets')
_NEXT_TOKEN = lambda key: NextToken(target_key=key)
# Config name -> Entry. A plain dict: a config must be able to name its model from the command
# line (a config file's get_model(config) or the Python API take any other model).
MODELS = {
    'mnist_mlp': Entry(_mnist_mlp, *_IMAGE),  # seed 004 part 2, Linen (Dropout + BatchNorm)
    'bobbin_mlp': Entry(_bobbin_mlp, *_IMAGE),  # seed 001, Linen (sigmoid + Dropout)
    'nnx_mlp': Entry(_nnx_mlp, *_IMAGE),  # seed 004's model in Flax NNX
    'jax_mlp': Entry(_jax_mlp, *_IMAGE),  # seed 004 part 1, plain functions over (w, b) pairs
    'keras_mlp': Entry(_keras_mlp, *_IMAGE),  # seed 000, Keras 3 functional with add_loss
    'char_lm': Entry(_char_lm, *_LM, task=_NEXT_TOKEN),  # deprecated: gpt at char_lm.py's size
    'gpt': Entry(gpt.build, *_LM, task=_NEXT_TOKEN),  # GPT-2 family (launch/configs/gpt.py)
    'llama': Entry(llama.build, *_LM, task=_NEXT_TOKEN),  # Llama family (launch/configs/llama.py)
    'qwen2': Entry(qwen.build_family('qwen2'), *_LM, task=_NEXT_TOKEN),  # Qwen2 / 2.5 (qwen.py)
    'qwen3': Entry(qwen.build_family('qwen3'), *_LM, task=_NEXT_TOKEN),  # Qwen3 dense (qwen.py)
    'mistral': Entry(mistral.build, *_LM, task=_NEXT_TOKEN),  # Mistral (mistral.py)
    'mixtral': Entry(mixtral.build, *_LM, task=_NEXT_TOKEN),  # Mixtral MoE (mixtral.py)
    'qwen3_moe': Entry(qwen.build_family('qwen3_moe'), *_LM, task=_NEXT_TOKEN),  # (qwen.py)
    'gemma2': Entry(gemma.build_family('gemma2'), *_LM, task=_NEXT_TOKEN),  # Gemma 2 (gemma.py)
    'gemma3': Entry(gemma.build_family('gemma3'), *_LM, task=_NEXT_TOKEN),  # Gemma 3 text
}


# family -> its parameters' Hugging Face names (disttrain/models/hf_names.py), from each family.
HF_NAMES = {**gpt.HF_NAMES, **llama.HF_NAMES, **qwen.HF_NAMES, **mistral.HF_NAMES,
            **mixtral.HF_NAMES, **gemma.HF_NAMES}


# Fields only some language-model families build: on another they would be silently ignored.
_GEMMA = ('gemma2', 'gemma3')
_BUILT_BY = {'sliding_window': ('llama', 'qwen2', 'qwen3', 'mistral', 'mixtral', 'qwen3_moe',
                                *_GEMMA),
             **{name: _GEMMA for name in ('sliding_window_pattern', 'query_pre_attn_scalar',
                                          'attn_softcap', 'final_softcap')},
             'local_rope_theta': ('gemma3',)}  # Gemma 2's config.json has one rotary base


def _entry(cfg: ModelConfig) -> Entry:
  if cfg.name not in MODELS:
    raise ConfigError(f'model.name={cfg.name!r} is not one of {tuple(MODELS)}; pick one of them')
  if MODELS[cfg.name].task is _NEXT_TOKEN:
    for name, families in _BUILT_BY.items():
      if getattr(cfg, name) and cfg.name not in families:
        raise ConfigError(f'model.{name}={getattr(cfg, name)}: model.name={cfg.name!r} does not '
                          f'build it (only {", ".join(families)} do); leave it at 0')
  return MODELS[cfg.name]


def build(cfg: ModelConfig, compute_dtype: str = 'float32', context: int = 128,
          matmul: str = 'default'):
  """The model that `cfg.name` names, reading cfg.input_key (default: the model's own).

  `context`: the run's data.seq_len, the default length of a GPT's positions table. `matmul`:
  precision.matmul, 'float8' for a language model's block projections (models/float8.py).
  """
  entry = _entry(cfg)
  model = entry.build(cfg, jnp.dtype(compute_dtype), context)
  if matmul != 'default':
    if not isinstance(model, LanguageModel):
      raise ConfigError(f'precision.matmul={matmul!r} multiplies the projections of language '
                        f"models; model.name={cfg.name!r} is not one: set "
                        "precision.matmul='default'")
    model = dataclasses.replace(model, module=model.module.clone(
        cfg=dataclasses.replace(model.cfg, matmul=matmul)))
  return dataclasses.replace(model, input_key=cfg.input_key or entry.input_key)


def task(cfg: ModelConfig):
  """The task of a config-named model on cfg.target_key (default: its own): classification, or
  token-weighted next-token cross-entropy for language models."""
  entry = _entry(cfg)
  return entry.task(cfg.target_key or entry.target_key)

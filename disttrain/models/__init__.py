"""Model front ends behind one protocol, and the models that configs name.

Front ends (the protocol is described in linen.py): LinenModel (Flax Linen), NNXModel (Flax
NNX; flax.nnx is imported on first use), FunctionalModel (plain init/apply functions over a
params pytree) and KerasModel (Keras 3, an optional extra: `from disttrain.models.keras import
KerasModel`, imported on demand so that disttrain runs without keras installed).
"""

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp

from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.models.functional import FunctionalModel
from disttrain.models.gpt import GPT, LanguageModel
from disttrain.models.linen import LinenModel
from disttrain.models.mlp import JAX_MLP_LOGICAL, BobbinMLP, MnistMLP, jax_mlp_apply, jax_mlp_init
from disttrain.task import Classification


def __getattr__(name: str):
  if name == 'NNXModel':  # flax.nnx is imported when an NNX model is used
    from disttrain.models.nnx import NNXModel  # pylint: disable=g-import-not-at-top
    return NNXModel
  raise AttributeError(f'module disttrain.models has no attribute {name!r}')


# Builders take the model config and the compute dtype; the MLPs compute in whatever dtype
# the step's precision policy casts their parameters and inputs to.
def _mnist_mlp(cfg: ModelConfig, dtype) -> LinenModel:
  del dtype
  return LinenModel(MnistMLP(num_classes=cfg.num_classes, hidden=cfg.hidden, dropout=cfg.dropout))


def _bobbin_mlp(cfg: ModelConfig, dtype) -> LinenModel:
  del dtype
  return LinenModel(BobbinMLP(num_classes=cfg.num_classes, hidden=cfg.hidden,
                              dropout=cfg.dropout))


def _nnx_mlp(cfg: ModelConfig, dtype):
  del dtype
  from disttrain.models.nnx import NNXModel  # pylint: disable=g-import-not-at-top
  from disttrain.models.nnx_mlp import NnxMLP  # pylint: disable=g-import-not-at-top
  return NNXModel(lambda rngs, input_shape: NnxMLP(input_shape, cfg.num_classes, cfg.hidden,
                                                   cfg.dropout, rngs=rngs))


def _jax_mlp(cfg: ModelConfig, dtype) -> FunctionalModel:
  del dtype
  return FunctionalModel(lambda rng, x: jax_mlp_init(rng, x, cfg.hidden, cfg.num_classes),
                         jax_mlp_apply, logical=JAX_MLP_LOGICAL)


def _keras_mlp(cfg: ModelConfig, dtype):
  del dtype
  try:
    from disttrain.models import keras_mlp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f"model.name='keras_mlp' needs keras ({e}); pip install '.[keras]'") from e
  return keras_mlp.model(cfg.num_classes, cfg.hidden)


def _check_heads(cfg: ModelConfig) -> None:
  if cfg.hidden % cfg.num_heads:
    raise ConfigError(f'model.hidden={cfg.hidden} is not divisible by model.num_heads='
                      f'{cfg.num_heads}; use a width that is a multiple of the head count')


def _char_lm(cfg: ModelConfig, dtype) -> LanguageModel:
  from disttrain.models.transformer import CharTransformer  # pylint: disable=g-import-not-at-top
  del dtype  # a float32 demo; gpt has a compute dtype
  _check_heads(cfg)
  return LanguageModel(CharTransformer(vocab_size=cfg.vocab_size, embed_dim=cfg.hidden,
                                       num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                                       mlp_dim=cfg.mlp_dim or 4 * cfg.hidden),
                       num_layers=cfg.num_layers, width=cfg.hidden,
                       lookup_params_per_position=cfg.hidden,
                       lookup_params=cfg.vocab_size * cfg.hidden)


def _gpt(cfg: ModelConfig, dtype) -> LanguageModel:
  _check_heads(cfg)
  module = GPT(vocab_size=cfg.vocab_size, width=cfg.hidden, num_layers=cfg.num_layers,
               num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim or 4 * cfg.hidden,
               tied_embeddings=cfg.tied_embeddings, norm=cfg.norm, remat=cfg.remat,
               dropout=cfg.dropout, dtype=dtype)
  return LanguageModel(module, num_layers=cfg.num_layers, width=cfg.hidden,
                       lookup_params_per_position=cfg.hidden,
                       lookup_params=0 if cfg.tied_embeddings else module.padded_vocab * cfg.hidden)


@dataclasses.dataclass(frozen=True)
class Entry:
  """How a config builds a model, and which batch fields it reads and learns by default."""
  build: Callable[[ModelConfig, Any], Any]  # (model config, compute dtype) -> model
  input_key: str
  target_key: str


_IMAGE, _LM = ('image', 'label'), ('tokens', 'targets')
# Config name -> Entry. A plain dict: a config must be able to name its model from the command
# line (a config file's get_model(config) or the Python API take any other model).
MODELS = {
    'mnist_mlp': Entry(_mnist_mlp, *_IMAGE),  # seed 004 part 2, Linen (Dropout + BatchNorm)
    'bobbin_mlp': Entry(_bobbin_mlp, *_IMAGE),  # seed 001, Linen (sigmoid + Dropout)
    'nnx_mlp': Entry(_nnx_mlp, *_IMAGE),  # seed 004's model in Flax NNX
    'jax_mlp': Entry(_jax_mlp, *_IMAGE),  # seed 004 part 1, plain functions over (w, b) pairs
    'keras_mlp': Entry(_keras_mlp, *_IMAGE),  # seed 000, Keras 3 functional with add_loss
    'char_lm': Entry(_char_lm, *_LM),  # small decoder-only byte-level transformer
    'gpt': Entry(_gpt, *_LM),  # GPT-class decoder-only transformer (launch/configs/gpt.py)
}


def _entry(cfg: ModelConfig) -> Entry:
  if cfg.name not in MODELS:
    raise ConfigError(f'model.name={cfg.name!r} is not one of {tuple(MODELS)}; pick one of them')
  return MODELS[cfg.name]


def build(cfg: ModelConfig, compute_dtype: str = 'float32'):
  """The model that `cfg.name` names, reading cfg.input_key (default: the model's own)."""
  entry = _entry(cfg)
  model = entry.build(cfg, jnp.dtype(compute_dtype))
  return dataclasses.replace(model, input_key=cfg.input_key or entry.input_key)


def task(cfg: ModelConfig) -> Classification:
  """The task of a config-named model: classification of cfg.target_key (default: its own)."""
  return Classification(label_key=cfg.target_key or _entry(cfg).target_key)

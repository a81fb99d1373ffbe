"""Model front ends behind one protocol, and the models that configs name.

Front ends (the protocol is described in linen.py): LinenModel (Flax Linen), NNXModel (Flax
NNX), FunctionalModel (plain init/apply functions over a params pytree) and KerasModel (Keras 3,
an optional extra: `from disttrain.models.keras import KerasModel`, imported on demand so that
disttrain runs without keras installed).
"""

from disttrain.config import ModelConfig
from disttrain.errors import ConfigError
from disttrain.models.functional import FunctionalModel
from disttrain.models.linen import LinenModel
from disttrain.models.mlp import (JAX_MLP_LOGICAL, BobbinMLP, MnistMLP, NnxMLP, jax_mlp_apply,
                                  jax_mlp_init)
from disttrain.models.nnx import NNXModel


def _mnist_mlp(cfg: ModelConfig, num_classes: int) -> LinenModel:
  return LinenModel(MnistMLP(num_classes=num_classes, hidden=cfg.hidden, dropout=cfg.dropout))


def _bobbin_mlp(cfg: ModelConfig, num_classes: int) -> LinenModel:
  return LinenModel(BobbinMLP(num_classes=num_classes, hidden=cfg.hidden, dropout=cfg.dropout))


def _nnx_mlp(cfg: ModelConfig, num_classes: int) -> NNXModel:
  return NNXModel(lambda rngs, input_shape: NnxMLP(input_shape, num_classes, cfg.hidden,
                                                   cfg.dropout, rngs=rngs))


def _jax_mlp(cfg: ModelConfig, num_classes: int) -> FunctionalModel:
  return FunctionalModel(lambda rng, x: jax_mlp_init(rng, x, cfg.hidden, num_classes),
                         jax_mlp_apply, logical=JAX_MLP_LOGICAL)


def _keras_mlp(cfg: ModelConfig, num_classes: int):
  try:
    from disttrain.models import keras_mlp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f"model.name='keras_mlp' needs keras ({e}); pip install '.[keras]'") from e
  return keras_mlp.model(num_classes, cfg.hidden)


def _char_lm(cfg: ModelConfig, num_classes: int) -> LinenModel:
  from disttrain.models.transformer import CharTransformer  # pylint: disable=g-import-not-at-top
  if cfg.hidden % cfg.num_heads:
    raise ConfigError(f'model.hidden={cfg.hidden} is not divisible by model.num_heads='
                      f'{cfg.num_heads}; use a width that is a multiple of the head count')
  return LinenModel(CharTransformer(vocab_size=num_classes, embed_dim=cfg.hidden,
                                    num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                                    mlp_dim=4 * cfg.hidden))


# Config name -> constructor(model config, num_classes). A plain dict: a config must be able to
# name its model from the command line.
MODELS = {
    'mnist_mlp': _mnist_mlp,  # seed 004 part 2, Linen (Dropout + BatchNorm)
    'bobbin_mlp': _bobbin_mlp,  # seed 001, Linen (sigmoid + Dropout)
    'nnx_mlp': _nnx_mlp,  # seed 004's model in Flax NNX
    'jax_mlp': _jax_mlp,  # seed 004 part 1, plain functions over a list of (w, b)
    'keras_mlp': _keras_mlp,  # seed 000, Keras 3 functional with add_loss
    'char_lm': _char_lm,  # decoder-only byte-level transformer (data.name='text')
}


def build(cfg: ModelConfig, num_classes: int):
  """The model that `cfg.name` names."""
  if cfg.name not in MODELS:
    raise ConfigError(f'model.name={cfg.name!r} is not one of {tuple(MODELS)}; pick one of them')
  return MODELS[cfg.name](cfg, num_classes)

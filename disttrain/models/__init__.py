"""Model front ends behind one protocol, and the models that configs name."""

from disttrain.models.linen import LinenModel
from disttrain.models.mlp import MnistMLP
from disttrain.config import ModelConfig
from disttrain.errors import ConfigError


def _mnist_mlp(cfg: ModelConfig, num_classes: int) -> LinenModel:
  return LinenModel(MnistMLP(num_classes=num_classes, hidden=cfg.hidden, dropout=cfg.dropout))


# Config name -> constructor(model config, num_classes). A plain dict: a config must be able to
# name its model from the command line.
MODELS = {'mnist_mlp': _mnist_mlp}


def build(cfg: ModelConfig, num_classes: int):
  """The model that `cfg.name` names."""
  if cfg.name not in MODELS:
    raise ConfigError(f'model.name={cfg.name!r} is not one of {tuple(MODELS)}; pick one of them')
  return MODELS[cfg.name](cfg, num_classes)

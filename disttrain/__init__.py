"""disttrain: one sharding-aware JAX training loop for one device, one host or a pod.

The public names below are imported on first use: a config file (`from disttrain import
config`) or a bad command line is then answered without loading jax, flax and orbax.
"""

import importlib

__version__ = '0.2.0'


# Public name -> the module that defines it.
_EXPORTS = {
    'STOP': 'callbacks', 'Callback': 'callbacks', 'CsvLogger': 'callbacks',
    'EarlyStopping': 'callbacks', 'Stop': 'callbacks',
    'Config': 'config', 'DataConfig': 'config', 'MeshConfig': 'config', 'ModelConfig': 'config',
    'defaults': 'config', 'from_config_dict': 'config',
    'CheckpointError': 'errors', 'ConfigError': 'errors', 'DataError': 'errors',
    'DisttrainError': 'errors', 'Interrupted': 'errors', 'NonFiniteError': 'errors',
    'Preempted': 'errors', 'ShardingError': 'errors',
    'Exit': 'exitcodes',
    'Result': 'loop', 'Setup': 'loop', 'evaluate': 'loop', 'setup': 'loop', 'train': 'loop',
    'Data': 'records',
    'TrainState': 'state',
    'StepContext': 'step',
    'FunctionalModel': 'models', 'LinenModel': 'models', 'NNXModel': 'models',
    'Classification': 'task', 'LossWithAux': 'task', 'NextToken': 'task', 'PerDeviceLoss': 'task',
    'generate': 'generate',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(f'disttrain.{_EXPORTS[name]}'), name)
  else:  # a submodule not imported yet (disttrain.run, disttrain.data, ...)
    try:
      value = importlib.import_module(f'disttrain.{name}')
    except ModuleNotFoundError as e:
      if e.name != f'disttrain.{name}':
        raise
      raise AttributeError(f'module disttrain has no attribute {name!r}') from None
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))

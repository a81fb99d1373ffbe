"""disttrain: one sharding-aware JAX training loop for one device, one host or a pod.

The public names below are imported on first use: a config file (`from disttrain import
config`) or a bad command line is then answered without loading jax, flax and orbax.
"""

import importlib

from disttrain import moved

moved.install()  # old module paths (disttrain.records, ...) keep working
__version__ = '0.3.0'


# Public name -> the module that defines it.
_EXPORTS = {
    'STOP': 'operating.callbacks', 'Callback': 'operating.callbacks',
    'CsvLogger': 'operating.callbacks', 'EarlyStopping': 'operating.callbacks',
    'Stop': 'operating.callbacks',
    'Config': 'config', 'DataConfig': 'config', 'MeshConfig': 'config', 'ModelConfig': 'config',
    'defaults': 'config', 'from_config_dict': 'config',
    'CheckpointError': 'errors', 'ConfigError': 'errors', 'DataError': 'errors',
    'DisttrainError': 'errors', 'Interrupted': 'errors', 'NonFiniteError': 'errors',
    'Preempted': 'errors', 'ShardingError': 'errors',
    'Exit': 'exitcodes',
    'Result': 'training.step_loop', 'Setup': 'training.setup', 'evaluate': 'training.loop',
    'setup': 'training.setup', 'train': 'training.loop',
    'Data': 'data.records',
    'TrainState': 'parallel.state',
    'StepContext': 'parallel.step',
    'FunctionalModel': 'models', 'LinenModel': 'models', 'NNXModel': 'models',
    'Classification': 'models.task', 'LossWithAux': 'models.task', 'NextToken': 'models.task',
    'PerDeviceLoss': 'models.task',
    'generate': 'hf.generate',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(f'disttrain.{_EXPORTS[name]}'), name)
  else:  # a submodule not imported yet (disttrain.data, or an old path: disttrain.loop, ...)
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

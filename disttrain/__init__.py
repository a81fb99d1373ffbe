"""disttrain: one sharding-aware JAX training loop for one device, one host or a pod."""

__version__ = '0.2.0'

from disttrain.callbacks import STOP, Callback, CsvLogger, EarlyStopping, Stop
from disttrain.config import Config, DataConfig, MeshConfig, ModelConfig, defaults, from_config_dict
from disttrain.errors import (CheckpointError, ConfigError, DataError, DisttrainError,
                              Interrupted, NonFiniteError, Preempted, ShardingError)
from disttrain.loop import Result, Setup, evaluate, setup, train
from disttrain.records import Data
from disttrain.state import TrainState
from disttrain.step import StepContext
from disttrain.models import FunctionalModel, LinenModel, NNXModel
from disttrain.task import Classification, LossWithAux, PerDeviceLoss

__all__ = ['STOP', 'Callback', 'CheckpointError', 'Classification', 'Config', 'ConfigError',
           'CsvLogger', 'Data', 'DataConfig', 'DataError', 'DisttrainError', 'EarlyStopping',
           'FunctionalModel', 'Interrupted', 'LinenModel', 'LossWithAux', 'MeshConfig',
           'ModelConfig', 'NNXModel', 'NonFiniteError', 'PerDeviceLoss', 'Preempted', 'Result',
           'Setup', 'ShardingError', 'Stop', 'StepContext', 'TrainState', 'defaults', 'evaluate',
           'from_config_dict', 'setup', 'train']

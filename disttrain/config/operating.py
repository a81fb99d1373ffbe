"""The groups the operating layer reads: early_stop.* (the EarlyStopping callback), profile.* (a
jax.profiler trace of a few steps) and tracking.* (MLflow and Weights & Biases)."""

import dataclasses
import re

from disttrain.config.checks import one_of, positive
from disttrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EarlyStopConfig:
  """Stop when an eval metric stopped improving (disttrain.EarlyStopping)."""
  metric: str = ''  # e.g. 'eval/accuracy' or 'val/loss'; '' = off
  mode: str = 'max'  # max or min
  patience: int = 3  # evals without an improvement of more than min_delta before stopping
  min_delta: float = 0.0  # the smallest change that counts as an improvement

  def __post_init__(self):
    one_of('early_stop.mode', self.mode, ('max', 'min'))
    positive('early_stop.patience', self.patience)
    positive('early_stop.min_delta', self.min_delta, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  """A jax.profiler trace of a few steps into DIR/plugins/profile (TensorBoard's layout)."""
  start_step: int = 0  # first traced step; 0 = off
  num_steps: int = 0  # steps traced; 0 = off
  all_processes: bool = False  # trace every process, not only process 0

  def __post_init__(self):
    positive('profile.start_step', self.start_step, allow_zero=True)
    positive('profile.num_steps', self.num_steps, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class TrackingConfig:
  """Experiment trackers that process 0 feeds (disttrain/operating/tracking.py): MLflow (the
  mlflow extra) and Weights & Biases (the wandb extra); both off by default."""
  mlflow_uri: str = ''  # MLflow: sqlite:////ABS/mlflow.db, http://HOST:5000, ...; '' = off
  wandb_mode: str = ''  # Weights & Biases: online or offline (no account needed); '' = off
  project: str = 'disttrain'  # MLflow experiment and W&B project
  run_name: str = ''  # the tracker run's name; '' = the workdir's base name
  wandb_dir: str = ''  # where W&B keeps its run files; '' = the workdir (if local), else W&B's own

  def __post_init__(self):
    one_of('tracking.wandb_mode', self.wandb_mode, ('', 'online', 'offline'))
    # MLflow takes a bare path as its deprecated file store: ask for an explicit scheme.
    if self.mlflow_uri and not re.match(r'^[a-zA-Z][a-zA-Z0-9+.-]*:', self.mlflow_uri):
      raise ConfigError(f'tracking.mlflow_uri={self.mlflow_uri!r} is not a URI; pass e.g. '
                        'sqlite:////ABS/PATH/mlflow.db or http://HOST:5000')
    if (self.mlflow_uri or self.wandb_mode) and not self.project:
      raise ConfigError("tracking.project='' names no MLflow experiment / W&B project; pass one")

"""Typed, one-line errors that users can catch; the launcher prints them without a traceback."""


class DisttrainError(Exception):
  """Base class: bad input from the user (config, flags, data, checkpoint)."""


class ConfigError(DisttrainError):
  """A config value is invalid or inconsistent with the machine."""


class ShardingError(DisttrainError):
  """A sharding rule cannot be applied to the mesh or to a parameter."""


class DataError(DisttrainError):
  """A data source is missing, malformed or too small."""


class CheckpointError(DisttrainError):
  """A checkpoint is missing, corrupt or does not fit the config."""


class NonFiniteError(DisttrainError):
  """Training produced a NaN or Inf."""

"""The field checks every group shares, each failing with one line naming the field and the fix."""

import math
from typing import Any

from disttrain.errors import ConfigError


def one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ConfigError(f'{name}={value!r} is not one of {allowed}; pick one of them')


def positive(name: str, value: int | float, allow_zero: bool = False) -> None:
  bound = '>= 0' if allow_zero else '> 0'
  if not math.isfinite(value):  # nan passes every comparison below
    raise ConfigError(f'{name}={value!r} is not a finite number; pass a value {bound}')
  if value < 0 or (value == 0 and not allow_zero):
    raise ConfigError(f'{name}={value!r} must be {bound}; pass a value {bound}')


def named_size(config_file: str, sizes: dict, size: str) -> Any:
  """sizes[size] for a shipped config's --config=FILE:SIZE, else one line listing the sizes."""
  if size not in sizes:
    raise ConfigError(f'--config={config_file}:{size}: no size {size!r} in {config_file}; '
                      f'pick one of {", ".join(sizes)}')
  return sizes[size]

"""The field checks every group shares, each failing with one line naming the field and the fix."""

import math
import os
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
  """sizes[size] for a shipped config's --config=FILE:SIZE (its __file__), else one line listing
  the sizes."""
  if size not in sizes:
    shown = os.path.relpath(config_file)  # as --config names it from here
    raise ConfigError(f'--config={shown}:{size}: no size {size!r} in {shown}; '
                      f'pick one of {", ".join(sizes)}')
  return sizes[size]

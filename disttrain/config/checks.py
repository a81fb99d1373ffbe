"""The field checks every group shares, each failing with one line naming the field and the fix."""

from typing import Any

from disttrain.errors import ConfigError


def one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ConfigError(f'{name}={value!r} is not one of {allowed}; pick one of them')


def positive(name: str, value: int | float, allow_zero: bool = False) -> None:
  if value < 0 or (value == 0 and not allow_zero):
    bound = '>= 0' if allow_zero else '> 0'
    raise ConfigError(f'{name}={value!r} must be {bound}; pass a value {bound}')

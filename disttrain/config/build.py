"""Config files and --config.<field> overrides in, a validated Config out.

`defaults()` turns the dataclasses into a locked `ml_collections.ConfigDict` (a locked
ConfigDict rejects unknown fields); `from_config_dict` turns the result back into a validated
`Config`, naming the first unknown field or wrong type in one line.
"""

import copy
import dataclasses
import sys
import typing
from typing import Any

import ml_collections

from disttrain.config.run import Config
from disttrain.errors import ConfigError


# Renamed fields, old path -> new path. The old names stay settable in config files and overrides
# (-1 = not set) and print one deprecation line; they are not part of the resolved Config.
DEPRECATED = {'data.synthetic_examples': 'data.synthetic.examples',
              'data.synthetic_features': 'data.synthetic.features',
              'data.text_bytes': 'data.text.bytes'}


def defaults(config: Config | None = None) -> ml_collections.ConfigDict:
  """A locked ConfigDict of every field, for config files and command-line overrides."""
  def to_plain(value):
    if dataclasses.is_dataclass(value):
      return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value
  tree = to_plain(config or Config())
  for old in DEPRECATED:
    group, name = old.split('.')
    tree[group][name] = -1
  cd = ml_collections.ConfigDict(tree)
  # data.mixture and data.mixture_stages take a string or a tuple (type-checked when built).
  cd.data = ml_collections.ConfigDict(tree['data'], type_safe=False)
  cd.lock()  # unknown fields in config files and --config.<field> overrides are errors
  return cd


def from_config_dict(cd: ml_collections.ConfigDict | dict) -> Config:
  """Builds and validates a Config; unknown fields or wrong types raise ConfigError."""
  tree = cd.to_dict() if isinstance(cd, ml_collections.ConfigDict) else copy.deepcopy(dict(cd))
  _apply_deprecated(tree)
  return _build(Config, tree, '')


def _apply_deprecated(tree: dict) -> None:
  """Moves values given under deprecated names to their new fields (one warning line each)."""
  for old, new in DEPRECATED.items():
    group, name = old.split('.')
    value = tree.get(group, {}).pop(name, -1)
    if value == -1:
      continue
    node, default = tree, Config()
    *parents, leaf = new.split('.')
    for part in parents:
      node, default = node.setdefault(part, {}), getattr(default, part)
    if node.get(leaf, value) not in (value, getattr(default, leaf)):  # the deprecated one won
      raise ConfigError(f'config fields {old}={value!r} (deprecated) and {new}={node[leaf]!r} '
                        f'are both set; drop {old}')
    print(f'warning: config field {old} is deprecated; use {new} (set to {value!r})',
          file=sys.stderr, flush=True)
    node[leaf] = value


def _build(cls, tree: dict, prefix: str):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(tree) - set(fields))
  if unknown:
    raise ConfigError(f'unknown config field {prefix}{unknown[0]}; known fields: '
                      f'{", ".join(prefix + n for n in fields)}')
  kwargs = {}
  for name, value in tree.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
      if not isinstance(value, dict):
        raise ConfigError(f'{prefix}{name} must be a group of fields, got {value!r}')
      kwargs[name] = _build(hint, value, f'{prefix}{name}.')
    else:
      kwargs[name] = _coerce(f'{prefix}{name}', value, hint)
  return cls(**kwargs)


def _coerce(name: str, value: Any, hint: Any) -> Any:
  """Checks a leaf's type; ints are accepted for floats, lists become tuples."""
  if hint is Any:  # checked by the field's own parser (data.mixture: a string or a tuple)
    return value
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint is tuple:
    if isinstance(value, (list, tuple)):
      return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    raise ConfigError(f'{name}={value!r} must be a tuple')
  if isinstance(hint, type) and not isinstance(value, hint) or (
      hint is int and isinstance(value, bool)):
    raise ConfigError(f'{name}={value!r} must be of type {hint.__name__}')
  return value

"""--config and its --config.<field>=<value> overrides as absl reads them: the config file's path,
and a bad flag, override or file as one line (absl prints a multi-line FATAL, config_flags an
AttributeError traceback for an unknown field; both before main).
"""

import re

from absl import flags
import ml_collections
from ml_collections import config_flags

from disttrain import commandline

EXAMPLE_CONFIG = 'launch/configs/mnist_mlp.py'
# A config override as config_flags finds it: --config.a.b=1, -config.a.b 1, --noconfig.flag.
_OVERRIDE = re.compile(r'^-{1,2}(?:no)?config\.([^=]+)')
_FLAG_VALUE_ERROR = re.compile(r'^flag --(\S+?)=(.*?): (.*)$')


def flag_error(error: flags.Error) -> str:
  """commandline.flag_error, with what only the train flags need: --config's order and groups."""
  message = str(error)
  if type(error).__name__ == 'FlagOrderError':  # ml_collections' (not exported)
    return f'{message}; put --config=FILE first, then its --config.<field>=<value> overrides'
  match = _FLAG_VALUE_ERROR.match(message)
  if match is not None:
    name, value, reason = match.groups()
    if name == 'config' and 'must have a value other than None' in reason:
      return f'--config is required; pass --config={EXAMPLE_CONFIG}'
    if name.startswith('config.') and isinstance(schema_value(name[len('config.'):]),
                                                 ml_collections.ConfigDict):
      return (f'--{name}={value!r}: {name[len("config."):]} is a group of fields, not a value; '
              f'set its fields instead, e.g. --{name}.<field>=<value>')
  return commandline.flag_error(error)


def schema_value(path: str):
  """The default of config field `path` ('mesh.data'), or None when there is no such field."""
  from disttrain import config as config_lib  # pylint: disable=g-import-not-at-top
  node = config_lib.defaults()
  for part in path.split('.'):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return None
    node = node[part]
  return node


def unknown_field(argv: list[str]) -> str | None:
  """The first --config.<path> override naming a field the config schema lacks, as one line."""
  from disttrain import config as config_lib  # pylint: disable=g-import-not-at-top
  schema = config_lib.defaults()
  for arg in argv:
    match = _OVERRIDE.match(arg)
    if match is None:
      continue
    node, prefix = schema, ''
    for part in match.group(1).split('.'):
      part = part.split('[', 1)[0]
      group = prefix[:-1] or 'config'
      if not isinstance(node, ml_collections.ConfigDict):
        return (f'{arg}: config field {group} is a value, it has no field {part!r}; '
                f'set --config.{group}=<value> instead')
      if part not in node:
        return (f'unknown config field {prefix}{part} in {arg}; {group} has fields '
                f'{", ".join(node.keys())}: use one of them')
      node, prefix = node[part], f'{prefix}{part}.'
  return None


def no_get_config(argv: list[str], error: Exception) -> str | None:
  """One line for a --config file that defines no get_config (config_flags' AttributeError)."""
  if isinstance(error, AttributeError) and "attribute 'get_config'" in str(error):
    return (f'--config={path(argv)!r} defines no get_config(); pass a config file whose '
            f'get_config() returns a ConfigDict, e.g. --config={EXAMPLE_CONFIG}')
  return None


def model_fields(argv: list[str]) -> set[str]:
  """The model fields --config.model.<field>[.<sub>]=... overrides name (top level)."""
  return {m.group(1).split('.')[1].split('[')[0] for m in map(_OVERRIDE.match, argv)
          if m and m.group(1).startswith('model.') and '.' in m.group(1)}


def agree_with_directory(cfg, argv: list[str]) -> None:
  """model.name='hf': the model fields argv sets, also to their defaults, must agree with
  restore_from's config.json."""
  if cfg.model.name == 'hf':
    from disttrain.hf import config as hf_config  # pylint: disable=g-import-not-at-top
    hf_config.refuse_contradictions(cfg, model_fields(argv))


def path(argv: list[str]) -> str:
  """The --config value as absl sees it: the last one given, a --flagfile's too."""
  try:
    return config_flags.get_config_filename(flags.FLAGS['config'])
  except flags.Error:  # unparsed (a parse error): the command line is what there is
    pass
  found = ''
  for i, arg in enumerate(argv):
    match = re.match(r'^-{1,2}config(=|$)', arg)
    if match:
      found = arg.split('=', 1)[1] if match.group(1) else (argv[i + 1] if i + 1 < len(argv) else '')
  return found


def load_error(argv: list[str], error: OSError) -> str:
  """One line for a config file that fails to load."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  return (f'--config={path(argv)!r} cannot be loaded ({lines[-1] if lines else error}); '
          f'pass --config=PATH to a config file, e.g. --config={EXAMPLE_CONFIG}')

"""A launch/configs recipe at a named size with dotted overrides ({'mesh.data': 1}), as the
benchmarks that sweep settings build their runs."""

import os
import runpy

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch',
                       'configs')


def config(name: str, size: str, overrides: dict):
  """launch/configs/<name>.py's get_config(size), with `overrides` set, as a disttrain.Config."""
  import disttrain  # pylint: disable=g-import-not-at-top
  cd = runpy.run_path(os.path.join(CONFIGS, f'{name}.py'))['get_config'](size)
  for key, value in overrides.items():
    node = cd
    *parents, leaf = key.split('.')
    for part in parents:
      node = node[part]
    node[leaf] = value
  return disttrain.from_config_dict(cd)

"""Fields that change a run only when another field is set.

Set alone they would be ignored (lora.alpha without a rank trains every weight), so a run
refuses them with one line (Config's checks) and a saved run's config drops them (hf/trained:
runs saved before a field was refused load as the model they trained). One table for both.
"""

import dataclasses
from typing import Any, Callable

from disttrain.config.data import DataConfig
from disttrain.config.post_training import DpoConfig, GrpoConfig, LoraConfig

_GROUPS = {'data': DataConfig, 'lora': LoraConfig, 'dpo': DpoConfig, 'grpo': GrpoConfig}
_SET_IT = 'which this run does not set; set it or drop the field'
_HARNESS = ('applies to data.eval_harness tasks, and none is named; set '
            'data.eval_harness=TASK[,...] or drop it')

# (a group, or fields of one, used when, what the line says after FIELD=VALUE)
_TABLE: tuple[tuple[tuple[str, ...], Callable[[Any], bool], str], ...] = (
    (('lora',), lambda c: c.lora.rank > 0, f'applies with lora.rank > 0, {_SET_IT}'),
    (('dpo',), lambda c: c.data.name == 'preference', f"applies with data.name='preference', "
                                                      f'{_SET_IT}'),
    (('grpo',), lambda c: c.data.name == 'prompts', f"applies with data.name='prompts', {_SET_IT}"),
    (('data.mixture_exhausted',), lambda c: bool(c.data.mixture),
     'applies to data.mixture sources; set data.mixture, or num_train_steps for one source'),
    (('data.eval_harness_limit', 'data.eval_harness_include'),
     lambda c: bool(c.data.eval_harness), _HARNESS),
    (('data.eval_files',), lambda c: c.data.name != 'prompts',
     "with data.name='prompts': GRPO has no eval split (the rewards of its samples are the "
     'measure); drop data.eval_files'),
)


def unused(config: Any) -> list[tuple[str, str]]:
  """(field, one line naming it and the fix) of each field `config` sets away from its default
  where it changes nothing; `config` is a Config or its ConfigDict."""
  found = []
  for fields, used, why in _TABLE:
    if used(config):
      continue
    for path in _expanded(fields):
      group, name = path.split('.')
      value = getattr(getattr(config, group), name)
      if _comparable(value) != _comparable(default(path)):
        found.append((path, f'{path}={value!r} {why}'))
  return found


def default(path: str) -> Any:
  """The default of a field 'group.name' of the table's groups."""
  group, name = path.split('.')
  field = {f.name: f for f in dataclasses.fields(_GROUPS[group])}[name]
  return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _expanded(fields: tuple[str, ...]) -> list[str]:
  return [f'{path}.{f.name}' for path in fields if '.' not in path
          for f in dataclasses.fields(_GROUPS[path])] + [p for p in fields if '.' in p]


def _comparable(value: Any) -> Any:
  """Lists and tuples alike: a saved run's config.json holds JSON lists."""
  return tuple(map(_comparable, value)) if isinstance(value, (list, tuple)) else value

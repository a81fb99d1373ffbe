"""lm-evaluation-harness's tasks by name, read before any model loads: the TaskManager (with the
YAML tasks of an include path), and, from its task index without loading a task, the names a run
writes records under and each generation task's length (groups and tags expanded). A task's
generation_kwargs are read here as lm-eval reads them. `lm_eval` is not a dependency of
disttrain: pip install lm_eval.
"""

import os

from disttrain.errors import ConfigError


def package():
  """(lm_eval, lm_eval.api.model), or one ConfigError saying how to install it."""
  try:
    import lm_eval  # pylint: disable=g-import-not-at-top
    from lm_eval.api import model as api_model  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError(f'lm-evaluation-harness is not installed ({e}); pip install lm_eval') from e
  return lm_eval, api_model


def names(text: str) -> list[str]:
  """'arc_easy, hellaswag' -> the task names (--tasks, data.eval_harness)."""
  return [t.strip() for t in text.split(',') if t.strip()]


def task_manager(tasks: list[str], include_path: str | None = None,
                 include_flag: str = '--include_path'):
  """lm_eval's TaskManager (with the YAML tasks under include_path); a task it does not know is
  one ConfigError naming it and `include_flag`, the caller's spelling of include_path."""
  package()
  given, include_path = include_path, include_path and os.path.expanduser(include_path)
  if include_path and not os.path.isdir(include_path):  # lm-eval skips it
    raise ConfigError(f'the include path {given!r} is not a directory; pass the directory '
                      'of your YAML tasks')
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  manager = TaskManager(include_path=include_path) if include_path else TaskManager()
  unknown = [t for t in tasks if t not in set(manager.all_tasks)]
  if unknown or not tasks:
    raise ConfigError((f'lm-eval knows no task {unknown[0]!r}' if unknown else 'no task given')
                      + (f' (its own tasks and those in {include_path})' if include_path else '')
                      + f'; list them with `lm_eval ls tasks`, or pass {include_flag}=DIR of '
                      'your YAML tasks')
  return manager


def _walk(manager, tasks: list[str]):
  """(name, its YAML config, whether it is a tag) of `tasks` and, groups and tags expanded, of
  every task under them, as lm-eval's task index describes them without loading them (config
  None: not in the index, or a tag). A tag (ai2_arc, mmlu's *_tasks) lists its tasks in the
  entry's `tags`; a group lists them in its config's `task`, by name or inline as {'task': ...}."""
  index, todo, seen = getattr(manager, 'task_index', {}), list(tasks), set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    entry = index.get(name)
    cfg = getattr(entry, 'cfg', None)
    tag = getattr(getattr(entry, 'kind', None), 'name', '') == 'TAG'
    yield name, cfg if isinstance(cfg, dict) else None, tag
    if tag:
      todo += sorted(getattr(entry, 'tags', None) or ())
    elif isinstance(cfg, dict) and 'group' in cfg and isinstance(cfg.get('task'), list):
      todo += [t['task'] if isinstance(t, dict) else t for t in cfg['task']
               if isinstance(t, str) or isinstance(t, dict) and isinstance(t.get('task'), str)]


def record_names(manager, tasks: list[str]) -> set[str]:
  """The names `tasks` write records under: each task and group, and every task of a group or
  tag (a tag writes none of its own)."""
  return {name for name, _, tag in _walk(manager, tasks) if not tag}


def generation_lengths(manager, tasks: list[str], default: int) -> dict[str, int]:
  """{task: max_gen_toks} of the generate_until tasks among `tasks` (groups, tags expanded) that
  lm-eval's task index describes without loading them (a type from an included YAML is not
  seen here: the backend checks it when the task runs)."""
  return {name: generation(cfg.get('generation_kwargs') or {}, default)[0]
          for name, cfg, _ in _walk(manager, tasks)
          if cfg is not None and cfg.get('output_type') == 'generate_until'}


def generation(kwargs: dict, default: int) -> tuple[int, list[str], bool]:
  """(max_gen_toks, stop strings, samples?) of a task's generation_kwargs, read as lm-eval's
  normalize_gen_kwargs reads them: the first of max_gen_toks, max_new_tokens, max_tokens,
  max_completion_tokens; do_sample=False is greedy whatever the temperature, and without
  do_sample a temperature > 0 samples."""
  kwargs = kwargs or {}
  until = kwargs.get('until') or []
  until = [until] if isinstance(until, str) else list(until)
  new = next((kwargs[k] for k in ('max_gen_toks', 'max_new_tokens', 'max_tokens',
                                  'max_completion_tokens') if kwargs.get(k) is not None), default)
  sample = kwargs.get('do_sample')
  if sample is None:
    sample = float(kwargs.get('temperature') or 0.0) > 0.0
  return int(new), until, bool(sample)

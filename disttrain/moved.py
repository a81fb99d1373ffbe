"""Paths that moved when the modules went into packages by layer, kept working for old code.

`import disttrain.records`, `from disttrain.loop import train` or `disttrain.storage.join(...)`
written against the flat layout (disttrain 0.2) resolve to the module's new home, the very same
module object, with a DeprecationWarning naming the new path. `python -m disttrain.export` (and
the other old commands) runs the command and prints its `disttrain export` spelling once.
This module imports nothing of disttrain: it only names paths, so any layer may use it.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

# disttrain.<old module> -> disttrain.<its home>. data, storage and hf are packages now; their
# __init__ answers the old module's names (see `names`).
MODULES = {
    'records': 'data.records', 'formats': 'data.formats', 'text': 'data.text',
    'tokenizer': 'data.tokenizer', 'packing': 'data.packing', 'sources': 'data.sources',
    'transforms': 'data.transforms', 'convert': 'data.convert',
    'mesh': 'parallel.mesh', 'sharding': 'parallel.sharding',
    'distributed': 'parallel.distributed', 'state': 'parallel.state', 'optim': 'parallel.optim',
    'step': 'parallel.step', 'compiled': 'parallel.compiled', 'spmd': 'parallel.spmd',
    'pmap': 'parallel.pmap', 'task': 'models.task', 'checkpoint': 'storage.checkpoint',
    'callbacks': 'operating.callbacks', 'metrics': 'operating.metrics',
    'tracking': 'operating.tracking', 'timing': 'operating.timing',
    'watchdog': 'operating.watchdog', 'events': 'operating.events',
    'goodput': 'operating.goodput', 'lease': 'operating.lease', 'plot': 'operating.plot',
    'hf_config': 'hf.config', 'tensorfiles': 'hf.tensorfiles', 'trained': 'hf.trained',
    'generate': 'hf.generate', 'export': 'hf.export',
    'run': 'training.setup', 'actions': 'training.actions', 'loop': 'training.loop',
}
# Old modules that were commands (python -m disttrain.<old>) -> their `disttrain` subcommand.
COMMANDS = {'convert': 'convert', 'tokenizer': 'tokenizer', 'export': 'export',
            'generate': 'generate', 'goodput': 'goodput', 'plot': 'plot'}
# Names a module had that now live in another layer or module: (its last dotted part, name) ->
# the new module.
NAMES = {('data', 'batch_sharding'): 'parallel.mesh',
         **{('sources', n): 'data.in_memory'
            for n in ('digits', 'text_files', 'text_bytes', 'unigram_entropy')},
         **{('batches', n): 'data.global_arrays' for n in ('local_rows', 'stacked_sharding')},
         ('step', 'micro_batches'): 'parallel.accumulation',
         **{('decoder', n): 'models.language_model' for n in ('LanguageModel', 'PACKED_FIELDS')},
         **{('setup', n): 'training.memory'
            for n in ('MemoryLimitError', 'preflight', 'memory_limit', 'mib', 'train_batch_spec',
                      'loop_variants', 'saved_activation_bytes')}}


# Frames a warning skips to point at the user's line: the import system's and disttrain's own.
_SKIP = ('<frozen importlib', os.path.dirname(importlib.__file__),
         os.path.join(os.path.dirname(os.path.abspath(__file__)), '__init__.py'), __file__)


def _warn(old: str, new: str) -> None:
  frame, level = sys._getframe(1), 2  # pylint: disable=protected-access
  while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
    name = frame.f_code.co_filename
    level += not ('importlib' in name and '_bootstrap' in name)  # warnings skips those itself
    frame = frame.f_back
  warnings.warn(f'{old} moved to {new}; import it from there (the old path goes in a later '
                'release)', DeprecationWarning, stacklevel=level)


def names(package: str, exports: dict[str, str]):
  """A package's (or module's) __getattr__: `exports` (name -> submodule) on first use, then the
  names (NAMES) it, or the old flat module of the same path, had that now live elsewhere."""

  def __getattr__(name: str):
    if name in exports:
      value = getattr(importlib.import_module(f'{package}.{exports[name]}'), name)
    elif (package.rsplit('.', 1)[-1], name) in NAMES:
      home = f'disttrain.{NAMES[package.rsplit(".", 1)[-1], name]}'
      _warn(f'{package}.{name}', f'{home}.{name}')
      value = getattr(importlib.import_module(home), name)
    else:
      raise AttributeError(f'module {package} has no attribute {name!r}')
    setattr(sys.modules[package], name, value)
    return value

  return __getattr__


class _Alias(importlib.abc.Loader):
  """Loads disttrain.<old> as the module now at disttrain.<new> (one object, two names)."""

  def __init__(self, old: str, new: str):
    self.old, self.new = old, new

  def create_module(self, spec):
    _warn(self.old, self.new)
    return importlib.import_module(self.new)

  def exec_module(self, module) -> None:
    sys.modules[self.old] = module  # the import system then returns this very module

  def get_code(self, fullname: str):
    """runpy's path: `python -m disttrain.<old>` runs the new module's code as __main__."""
    del fullname
    short = self.old.split('.', 1)[1]
    now = f'disttrain {COMMANDS[short]}' if short in COMMANDS else f'python -m {self.new}'
    print(f'note: `python -m {self.old}` is now `{now}` (same flags); the old spelling still '
          'works for now', file=sys.stderr, flush=True)
    return importlib.util.find_spec(self.new).loader.get_code(self.new)


class _Finder(importlib.abc.MetaPathFinder):
  """Answers only for disttrain.<old>, after the normal finders found no such module."""

  def find_spec(self, fullname: str, path=None, target=None):
    del path, target
    package, _, short = fullname.partition('.')
    if package != 'disttrain' or short not in MODULES:
      return None
    new = f'disttrain.{MODULES[short]}'
    origin = importlib.util.find_spec(new).origin
    return importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new), origin=origin)


def install() -> None:
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())

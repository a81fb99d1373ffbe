"""The package layout holds: each module imports only from its own layer or lower ones, no
import cycle, every module has a layer, and the architecture page draws every package and its modules.

Read from the source (every import statement, also inside functions), so it costs no import."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'disttrain'

# The layer order, lowest first: a module may import from its own layer and the ones below.
# A module's layer is that of the longest entry its dotted name starts with. The root package
# sits at the bottom: it imports `moved` alone, its public names load on first use.
LAYERS = (
    ('disttrain', 'disttrain.errors', 'disttrain.exitcodes', 'disttrain.moved'),
    ('disttrain.config', 'disttrain.config_reference'),
    ('disttrain.data',),
    ('disttrain.parallel',),
    ('disttrain.models', 'disttrain.storage'),
    ('disttrain.operating',),
    ('disttrain.hf',),
    ('disttrain.evaluation',),
    ('disttrain.training',),
    ('disttrain.launch', 'disttrain.cli', 'disttrain.__main__'),
)


def _modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
  found = {}
  for path in sorted(package.rglob('*.py')):
    parts = path.relative_to(package.parent).with_suffix('').parts
    found['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
  return found


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  """module -> the disttrain modules it imports (`from a import b`: a.b if that is a module)."""
  edges = {}
  for name, path in modules.items():
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets |= {alias.name for alias in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        targets |= {f'{node.module}.{a.name}' if f'{node.module}.{a.name}' in modules
                    else node.module for a in node.names}
    edges[name] = {t for t in targets if t in modules and t != name}
  return edges


def _layer(module: str) -> int | None:
  best = None
  for index, entries in enumerate(LAYERS):
    for entry in entries:
      if (module == entry or module.startswith(entry + '.')) and (
          best is None or len(entry) > len(best[1])):
        best = (index, entry)
  return None if best is None else best[0]


def _upward(package: pathlib.Path = PACKAGE) -> list[str]:
  modules = _modules(package)
  unplaced = [m for m in modules if _layer(m) is None]
  assert not unplaced, f'modules with no layer: {unplaced}; add them to LAYERS'
  return [f'{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})'
          for m, targets in _imports(modules).items() for t in sorted(targets)
          if _layer(t) > _layer(m)]


def test_no_module_imports_from_a_higher_layer():
  upward = _upward()
  assert not upward, 'imports that run up the layers:\n' + '\n'.join(upward)


def test_no_import_cycle():
  edges = _imports(_modules())
  state, cycles = {}, []

  def visit(module: str, path: list[str]) -> None:
    state[module] = 'open'
    for target in sorted(edges[module]):
      if state.get(target) == 'open':
        cycles.append(path[path.index(target):] + [target])
      elif target not in state:
        visit(target, path + [target])
    state[module] = 'done'

  for module in sorted(edges):
    if module not in state:
      visit(module, [module])
  assert not cycles, 'import cycles: ' + '; '.join(' -> '.join(c) for c in cycles)


def test_the_layer_test_catches_an_upward_import(tmp_path):
  """The check above on a copy of the package whose record layer imports the training loop."""
  for path in PACKAGE.rglob('*.py'):
    target = tmp_path / 'disttrain' / path.relative_to(PACKAGE)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(path.read_text())
  records = tmp_path / 'disttrain' / 'data' / 'records.py'
  late = '\n\ndef _late():\n  from disttrain.training import loop\n'
  records.write_text(records.read_text() + late)
  assert _upward(tmp_path / 'disttrain') == [
      'disttrain.data.records (layer 2) imports disttrain.training.loop (layer 8)']


def test_the_architecture_page_draws_every_package():
  page = (ROOT / 'docs' / 'contributing' / 'architecture.md').read_text()
  packages = sorted(p.parent.name for p in PACKAGE.glob('*/__init__.py'))
  missing = [p for p in packages if f'{p}/' not in page]
  assert not missing, f'docs/contributing/architecture.md does not draw {missing}'
  for entries in LAYERS[1:]:
    for entry in entries:
      assert entry.split('.', 1)[1].replace('.', '/') in page, entry
  # Every module has an entry in its package's block ('  hf/' up to the next package): a line
  # '    name.py   what it does' (or 'a.py, b.py  ...'), or the package's own heading lines.
  blocks = {m[1]: m[0] for m in re.finditer(r'(?m)^  (\w+)/.*\n(?:(?:    .*)?\n)*', page)}
  for package in packages:
    heading, *entries = re.split(r'(?m)^(?=    \S)', blocks.get(package, ''))
    named = set(re.findall(r'\w+\.py', heading))
    for entry in entries:  # the names before the description
      named.update(re.findall(r'\w+\.py', re.split(r'\s{2,}', entry.strip())[0]))
    modules = sorted(p.name for p in (PACKAGE / package).glob('*.py') if p.name != '__init__.py')
    unnamed = sorted(set(modules) - named)
    assert not unnamed, f'docs/contributing/architecture.md: {package}/ has no entry for {unnamed}'

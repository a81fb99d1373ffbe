"""The docs cannot go stale: the site builds strictly, the config reference covers every field,
the docs name no field that does not exist, and every documented command parses with today's
flags and config (`launch/train.py --check`, absl flag parsing for the other entry points)."""

import ast
import concurrent.futures
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from disttrain import config as config_lib
from disttrain import config_reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
GROUPS = ('data', 'model', 'mesh', 'precision', 'early_stop', 'profile', 'tracking')
# A command line the docs show as runnable: a python entry point of this repository.
_ENTRY = re.compile(r'^python3? (?:-m disttrain\.|launch/|benchmarks/)')
_TEMPLATE = re.compile(r'[\[<|]|\.\.\.')  # [optional] / <placeholder> / a|b / ...: usage


def _known_paths() -> set[str]:
  paths = {f.path for f in config_reference.fields()} | set(config_lib.DEPRECATED)
  return paths | {p.rsplit('.', i)[0] for p in paths for i in range(1, p.count('.') + 1)}


def test_every_config_field_has_documentation_and_the_reference_lists_it():
  fields = config_reference.fields()
  undocumented = [f.path for f in fields if not f.doc]
  assert not undocumented, (f'config fields without a comment in disttrain/config.py: '
                            f'{undocumented}; document each (the docs are generated from them)')
  page = config_reference.markdown()
  flat = _flatten(config_lib.defaults().to_dict())
  assert sorted(f.path for f in fields) == sorted(p for p in flat if p not in config_lib.DEPRECATED)
  for field in fields:
    assert f'| `{field.path}` |' in page
  assert '| `model.num_kv_heads` | int | `0` | llama: K/V heads shared' in page


def _flatten(tree: dict, prefix: str = '') -> list[str]:
  out = []
  for name, value in tree.items():
    out += _flatten(value, f'{prefix}{name}.') if isinstance(value, dict) else [prefix + name]
  return out


def test_a_field_without_a_comment_is_caught(tmp_path):
  """The check above on a copy of config.py with one uncommented field added."""
  source = pathlib.Path(config_lib.__file__).read_text()
  marker = "  lease_seconds: float = 60.0\n"
  assert marker in source
  patched = source.replace(marker, marker + '  new_knob: int = 3\n')
  spec_dir = tmp_path / 'disttrain'
  spec_dir.mkdir()
  (spec_dir / 'config.py').write_text(patched)
  script = textwrap.dedent(f"""
      import importlib.util, sys
      import disttrain, disttrain.mesh, disttrain.errors
      path = {str(spec_dir / 'config.py')!r}
      spec = importlib.util.spec_from_file_location('disttrain.config', path)
      module = importlib.util.module_from_spec(spec); sys.modules['disttrain.config'] = module
      spec.loader.exec_module(module); disttrain.config = module
      from disttrain import config_reference
      print([f.path for f in config_reference.fields() if not f.doc])
  """)
  out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=True,
                       cwd=ROOT).stdout
  assert out.strip() == "['new_knob']"


def test_the_docs_name_no_config_field_that_does_not_exist():
  known, stale = _known_paths(), []
  for page in PAGES:
    text = page.read_text()
    names = [m.group(1).rstrip('.') for m in re.finditer(r'--config\.([A-Za-z_][\w.]*)', text)]
    names += [m.group(1) for m in re.finditer(
        r'`((?:%s)\.[A-Za-z_][\w.]*)(?:=[^`]*)?`' % '|'.join(GROUPS), text)
              if not re.search(r'\.(json|py|md|npy|bin|txt|model)$', m.group(1))]
    stale += [f'{page.relative_to(ROOT)}: {name}' for name in names if name not in known]
  assert not stale, f'the docs name config fields that do not exist: {stale}'


def _commands() -> list[tuple[str, list[str]]]:
  """(page, argv) of every python command in a bash block or an inline code span of the docs."""
  found = []
  for page in PAGES:
    text = page.read_text()
    lines = []
    for lang, body in re.findall(r'```(\w*)\n(.*?)```', text, re.S):
      if lang in ('bash', 'sh', 'shell'):
        lines += body.replace('\\\n', ' ').split('\n')
    text_outside = re.sub(r'```.*?```', '', text, flags=re.S)
    lines += [span for span in re.findall(r'`([^`\n]+)`', text_outside) if _ENTRY.match(span)]
    for line in lines:
      for part in line.split('&&'):
        part = re.sub(r'^(taskset -c \S+|\w+=\S+)\s+', '', part.strip())
        if _ENTRY.match(part) and ' ' in part.split('disttrain.', 1)[-1] and not (
            _TEMPLATE.search(part)):  # (a bare `python -m disttrain.x` names a tool)
          if part.count("'") % 2:  # the end of a quoted remote command (gcloud ... --command='...')
            part = part.rstrip("'")
          argv = shlex.split(part, comments=True)
          found.append((str(page.relative_to(ROOT)), argv[1:]))
  return found


_DRIVER = textwrap.dedent("""
    # Imports one entry point's dependencies once, then runs its __main__ block in a forked
    # child per command with absl's app.run replaced: the flags are parsed as the real run
    # parses them (launch/train.py: its own parser, then main with --check), nothing else runs.
    import importlib, importlib.util, json, os, runpy, sys
    from absl import app, flags
    entry, commands = sys.argv[1], json.loads(sys.stdin.read())
    script, defined = entry.endswith('.py'), set(flags.FLAGS)
    if script:
      sys.path[:0] = [os.path.dirname(os.path.abspath(entry)), os.getcwd()]
      spec = importlib.util.spec_from_file_location('docs_entry', entry)
      spec.loader.exec_module(importlib.util.module_from_spec(spec))
    else:
      importlib.import_module(entry)
      del sys.modules[entry]
    import disttrain.config, disttrain.storage, disttrain.exitcodes  # what launch/train.py loads
    for name in set(flags.FLAGS) - defined:  # the child's run defines them again
      delattr(flags.FLAGS, name)

    def parse_only(main, argv=None, flags_parser=None):
      rest = (flags_parser or flags.FLAGS)(sys.argv)
      if entry == 'launch/train.py':
        main(rest)
      sys.exit(0)

    results = []
    for argv in commands:
      read, write = os.pipe()
      pid = os.fork()
      if pid == 0:
        os.close(read); os.dup2(write, 1); os.dup2(write, 2)
        sys.argv = [entry] + argv
        app.run = parse_only
        try:
          runpy.run_path(entry, run_name='__main__') if script else runpy.run_module(
              entry, run_name='__main__', alter_sys=True)
          code = 0
        except SystemExit as e:
          code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # absl raises some flag errors before its own handler
          print(f'{type(e).__name__}: {e}'); code = 1
        sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
      os.close(write)
      with os.fdopen(read) as pipe:
        output = pipe.read()
      results.append([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), output])
    print(json.dumps(results))
""")


def _expand(argv: list[str]) -> list[tuple[str, list[str]]]:
  """(entry, args) to check for one documented command, following the wrappers' `--`."""
  entry, args = (argv[1], argv[2:]) if argv[0] == '-m' else (argv[0], argv[1:])
  if entry == 'launch/train.py':
    return [(entry, args + ['--check'])]
  if entry in ('launch/supervise.py', 'launch/local_cluster.py') and '--' in args:
    own, rest = args[:args.index('--')], args[args.index('--') + 1:]
    inner = _expand(rest[1:]) if entry == 'launch/supervise.py' else [
        ('launch/train.py', rest + ['--check'])]
    return [(entry, own)] + inner
  return [(entry, args)]


def test_every_documented_command_parses():
  by_entry: dict[str, list] = {}
  commands = _commands()
  for page, argv in commands:
    for entry, args in _expand(argv):
      by_entry.setdefault(entry, []).append((page, args))
  assert len(commands) >= 30 and {'launch/train.py', 'disttrain.convert', 'launch/supervise.py',
                                   'launch/local_cluster.py'} <= set(by_entry)
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}

  def check(entry_items):  # one driver per entry point, two at a time (their imports dominate)
    entry, items = entry_items
    return subprocess.run([sys.executable, '-c', _DRIVER, entry],
                          input=json.dumps([args for _, args in items]), capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)

  failures = []
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    procs = list(pool.map(check, by_entry.items()))
  for (entry, items), proc in zip(by_entry.items(), procs):
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (page, args), (code, output) in zip(items, results):
      if code != 0:
        failures.append(f'{page}: {entry} {shlex.join(args)} -> exit {code}: {output[-300:]}')
  assert not failures, '\n'.join(failures)


def test_readme_is_a_landing_page_and_ci_runs_its_test_command():
  readme = (ROOT / 'README.md').read_text()
  assert len(readme.splitlines()) <= 200
  command = re.search(r'^# 2\. .*\n(.*)$', readme, re.M).group(1)
  assert command.endswith('python -m pytest -q')
  assert command in (ROOT / '.ci' / 'run').read_text()


def test_the_site_builds_strictly_with_every_page(tmp_path):
  site = tmp_path / 'site'
  proc = subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--strict', '-q', '-d',
                         str(site)], capture_output=True, text=True, cwd=ROOT,
                        env={**os.environ, 'NO_MKDOCS_2_WARNING': '1'}, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for page in ('getting-started', 'data', 'models', 'language-models', 'scaling', 'operating',
               'unattended', 'launching', 'command-line', 'outputs', 'performance',
               'reference/config', 'reference/api', 'contributing/architecture',
               'contributing/tests'):
    assert (site / page / 'index.html').is_file(), page
  config_page = (site / 'reference' / 'config' / 'index.html').read_text()
  assert 'model.num_kv_heads' in config_page and 'mesh.stage' in config_page
  api_page = (site / 'reference' / 'api' / 'index.html').read_text()
  assert 'disttrain.loop.train' in api_page
  index = (site / 'index.html').read_text()
  assert 'python -m pytest -q' in index and 'href="scaling/"' in index


@pytest.mark.slow
def test_the_readme_python_example_runs_and_learns(tmp_path):
  code = re.search(r'```python\n(.*?)```', (ROOT / 'README.md').read_text(), re.S).group(1)
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}  # the example sets its own
  proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  final = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the last record, printed
  assert final['split'] == 'eval' and final['step'] == 300 and final['num_examples'] == 297
  assert final['accuracy'] > 0.85, final
  assert "{'data': 8," in proc.stdout  # 8 devices, data parallel

"""The docs cannot go stale: the site builds strictly, the config reference covers every field,
the docs name no field that does not exist, and every documented command parses with today's
flags and config in both its spellings (`disttrain <sub>` and `python launch/*.py` or the older
`python -m disttrain.<tool>`; training commands with --check, absl flag parsing for the rest)."""

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

from disttrain import cli, config as config_lib, config_reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
GROUPS = ('data', 'model', 'mesh', 'precision', 'early_stop', 'profile', 'tracking', 'lora',
          'dpo')
# A command line the docs show as runnable: the disttrain command or a python entry point here.
_ENTRY = re.compile(r'^(?:disttrain [a-z]|python3? (?:-m disttrain\.|launch/|benchmarks/))')
_TEMPLATE = re.compile(r'[\[<|]|\.\.\.')  # [optional] / <placeholder> / a|b / ...: usage


def _known_paths() -> set[str]:
  paths = {f.path for f in config_reference.fields()} | set(config_lib.DEPRECATED)
  return paths | {p.rsplit('.', i)[0] for p in paths for i in range(1, p.count('.') + 1)}


def test_every_config_field_has_documentation_and_the_reference_lists_it():
  fields = config_reference.fields()
  undocumented = [f.path for f in fields if not f.doc]
  assert not undocumented, (f'config fields without a comment in disttrain/config/: '
                            f'{undocumented}; document each (the docs are generated from them)')
  page = config_reference.markdown()
  flat = _flatten(config_lib.defaults().to_dict())
  assert sorted(f.path for f in fields) == sorted(p for p in flat if p not in config_lib.DEPRECATED)
  for field in fields:
    assert f'| `{field.path}` |' in page
  assert '| `model.num_kv_heads` | int | `0` | llama, qwen: K/V heads shared' in page


def _flatten(tree: dict, prefix: str = '') -> list[str]:
  out = []
  for name, value in tree.items():
    out += _flatten(value, f'{prefix}{name}.') if isinstance(value, dict) else [prefix + name]
  return out


def test_a_field_without_a_comment_is_caught(tmp_path):
  """The check above on a copy of config/run.py with one uncommented field added."""
  source = pathlib.Path(config_lib.run.__file__).read_text()
  marker = "  lease_seconds: float = 60.0\n"
  assert marker in source
  patched = source.replace(marker, marker + '  new_knob: int = 3\n')
  spec_dir = tmp_path / 'disttrain'
  spec_dir.mkdir()
  (spec_dir / 'run.py').write_text(patched)
  script = textwrap.dedent(f"""
      import importlib.util, sys
      import disttrain.config
      path = {str(spec_dir / 'run.py')!r}
      spec = importlib.util.spec_from_file_location('disttrain.config.run', path)
      module = importlib.util.module_from_spec(spec); sys.modules['disttrain.config.run'] = module
      spec.loader.exec_module(module); disttrain.config.Config = module.Config
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
  """(page, argv) of every command in a bash block or an inline code span of the docs."""
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
      # Commands joined by && or ; (outside quotes: data.mixture's value holds ';').
      for part in re.findall(r"""(?:'[^']*'|"[^"]*"|[^;&'"]|(?<!&)&(?!&))+""", line):
        part = re.sub(r'^(?:do |srun \S+ |taskset -c \S+ |\w+=\S+ )+', '', part.strip())
        if _ENTRY.match(part) and not _TEMPLATE.search(part):
          if part.count("'") % 2:  # the end of a quoted remote command (gcloud ... --command='...')
            part = part.rstrip("'")
          argv = shlex.split(part, comments=True)
          if len(argv) > (3 if argv[1] == '-m' else 2):  # a bare `disttrain convert` names a tool
            found.append((str(page.relative_to(ROOT)), argv))
  return found


# The two spellings of each program: `disttrain <sub>` and the one it replaces or keeps beside it.
_SCRIPTS = {'train': 'launch/train.py', 'supervise': 'launch/supervise.py',
            'cluster': 'launch/local_cluster.py'}
_TOOLS = ('convert', 'tokenizer', 'export', 'generate', 'goodput', 'plot')


def _canonical(argv: list[str]) -> tuple[str, str, list[str]]:
  """(program, its `disttrain` subcommand, args) of a documented command in either spelling;
  the program of a benchmark is its script."""
  if argv[0] == 'disttrain':
    return ('train' if argv[1] == 'check' else argv[1]), argv[1], argv[2:]
  argv = argv[1:]  # python ...
  if argv[0] == '-m':
    tool = argv[1].split('.', 1)[1]
    return tool, tool, argv[2:]
  for sub, script in _SCRIPTS.items():
    if argv[0] == script:
      return sub, sub, argv[1:]
  return argv[0], '', argv[1:]


def _checks(argv: list[str]) -> list[tuple[str, str, list[str]]]:
  """(program, spelling, argv) to parse for one documented command: each spelling of the
  program, following supervise's and cluster's `--` into the command they run."""
  program, sub, args = _canonical(argv)
  inner = []
  if program in ('supervise', 'cluster') and '--' in args:
    own, rest = args[:args.index('--')], args[args.index('--') + 1:]
    inner = _checks(rest) if program == 'supervise' else _checks(['disttrain', 'check', *rest])
    args = own
  if not sub:
    return [(program, 'script', [program, *args])] + inner
  check = ['--check'] if program == 'train' and sub == 'train' else []  # parse, run nothing
  legacy_args = args + (['--check'] if sub == 'check' else check)
  if program in _SCRIPTS:
    legacy = [(program, 'script', [_SCRIPTS[program], *legacy_args])]
  else:  # subcommands born after the flat layout have no old spelling
    legacy = [(program, 'module', [program, *legacy_args])] if program in _TOOLS else []
  return [(program, 'disttrain', [sub, *args, *check]), *legacy] + inner


_DRIVER = textwrap.dedent("""
    # Imports one program's dependencies once, then runs it in a forked child per command, in
    # the spelling asked for (`disttrain <sub>` through disttrain.cli, a launch/ script, an old
    # `python -m disttrain.<tool>`, a benchmark script), with absl's app.run replaced: the flags
    # are parsed as the real run parses them (train: its own parser, then main with --check).
    import importlib, json, os, runpy, sys
    from absl import app, flags
    from disttrain import cli
    program, commands = sys.argv[1], json.loads(sys.stdin.read())
    if program == 'train':  # its --check imports jax, flax, ...: 1.5 s a command, 62 commands
      from tests.forked_launcher import PRELOAD
      for name in PRELOAD:
        importlib.import_module(name)
    defined = set(flags.FLAGS)
    if program.endswith('.py'):
      sys.path[:0] = [os.path.dirname(os.path.abspath(program)), os.getcwd()]
      module = None
    else:
      module = cli.COMMANDS[program][0]
      importlib.import_module(module)
      del sys.modules[module]
    for name in set(flags.FLAGS) - defined:  # the child's run defines them again
      delattr(flags.FLAGS, name)

    def parse_only(main, argv=None, flags_parser=None):
      rest = (flags_parser or flags.FLAGS)(sys.argv)
      if program == 'train':
        main(rest)
      sys.exit(0)

    results = []
    for spelling, argv in commands:
      read, write = os.pipe()
      pid = os.fork()
      if pid == 0:
        os.close(read); os.dup2(write, 1); os.dup2(write, 2)
        app.run = parse_only
        try:
          if spelling == 'disttrain':
            cli.main(['disttrain', *argv])
          elif spelling == 'script':
            sys.argv = argv
            runpy.run_path(argv[0], run_name='__main__')
          else:  # the old `python -m disttrain.<tool>`
            sys.argv = argv
            runpy.run_module(f'disttrain.{argv[0]}', run_name='__main__', alter_sys=True)
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


def test_every_documented_command_parses_in_both_spellings():
  by_program: dict[str, list] = {}
  commands = _commands()
  for page, argv in commands:
    for program, spelling, args in _checks(argv):
      by_program.setdefault(program, []).append((page, spelling, args))
  spellings = {(program, spelling) for program, items in by_program.items()
               for _, spelling, _ in items}
  documented = {args[0] for items in by_program.values() for _, spelling, args in items
                if spelling == 'disttrain'}
  assert documented == set(cli.COMMANDS), f'no page runs {set(cli.COMMANDS) - documented}'
  assert len(commands) >= 30 and {('train', 'disttrain'), ('train', 'script'),
                                   ('convert', 'disttrain'), ('convert', 'module'),
                                   ('supervise', 'script'), ('cluster', 'disttrain')} <= spellings
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}

  def check(program_items):  # one driver per program, two at a time (their imports dominate)
    program, items = program_items
    return subprocess.run([sys.executable, '-c', _DRIVER, program],
                          input=json.dumps([[spelling, args] for _, spelling, args in items]),
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)

  failures = []
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    procs = list(pool.map(check, by_program.items()))
  for (program, items), proc in zip(by_program.items(), procs):
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (page, spelling, args), (code, output) in zip(items, results):
      if code != 0:
        failures.append(f'{page}: {program} ({spelling}) {shlex.join(args)} -> exit {code}: '
                        f'{output[-300:]}')
  assert not failures, '\n'.join(failures)


def test_readme_is_a_landing_page_and_ci_runs_its_test_command():
  readme = (ROOT / 'README.md').read_text()
  assert len(readme.splitlines()) <= 200
  command = re.search(r'^# 2\. .*\n(.*)$', readme, re.M).group(1)
  assert command.endswith('python -m pytest -q')
  assert command in (ROOT / '.ci' / 'run').read_text()


def test_the_readme_and_the_command_line_page_name_every_subcommand():
  readme = (ROOT / 'README.md').read_text()
  listed = re.search(r'subcommands are what you run:\n(.*?)\n\(`disttrain --help`', readme, re.S)
  page = (ROOT / 'docs' / 'command-line.md').read_text()
  assert set(re.findall(r'`([a-z-]+)`', listed.group(1))) == set(cli.COMMANDS)
  assert set(re.findall(r'^\| `disttrain ([a-z-]+)', page, re.M)) == set(cli.COMMANDS)


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
  assert 'disttrain.training.loop.train' in api_page
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

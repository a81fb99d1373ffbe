"""The `disttrain` command and the spellings it replaces: every subcommand answers --help with its
own flags, the installed script runs them, old module paths are the same modules (with a
DeprecationWarning at the user's line) and an old `python -m disttrain.<tool>` runs the tool,
saying its new spelling once. (Real runs of each subcommand: test_launcher, test_supervise,
test_multiprocess, test_text_data, test_hf, test_generate, test_goodput, test_operations.)"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

from disttrain import cli
from tests.conftest import ROOT
from tests.test_goodput import _log

SCRIPT = pathlib.Path(sys.executable).parent / 'disttrain'  # what `pip install` put on the PATH


def _run(*argv: str, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=120,
                        check=False, env={**os.environ, 'JAX_PLATFORMS': 'cpu'}, **kw)


def test_the_installed_script_lists_the_subcommands_and_refuses_an_unknown_one():
  assert SCRIPT.is_file(), f'no {SCRIPT}: `pip install -e .` installs the disttrain command'
  listing = _run(str(SCRIPT), '--help')
  assert listing.returncode == 0, listing.stderr
  assert [line.split()[0] for line in listing.stdout.splitlines()[2:]] == list(cli.COMMANDS)
  bad = _run(str(SCRIPT), 'trian', '--config=x')
  assert bad.returncode == 2 and bad.stdout == '', bad
  assert bad.stderr.splitlines() == [
      "error: disttrain has no subcommand 'trian'; use one of train, check, batch-size, "
      'supervise, cluster, export, generate, lm-eval, compare, convert, tokenizer, goodput, '
      'plot '
      '(disttrain --help)']


_FORKED = textwrap.dedent("""
    # `disttrain ARGS...` for each list of ARGS in argv[1] (JSON), each in a forked child (one
    # import of jax); prints {' '.join(ARGS): [exit code, output]}.
    import json, os, sys
    import jax, flax, orbax.checkpoint  # what most subcommands load
    from disttrain import cli
    out = {}
    for args in json.loads(sys.argv[1]):
      read, write = os.pipe()
      pid = os.fork()
      if pid == 0:
        os.close(read); os.dup2(write, 1); os.dup2(write, 2)
        try:
          cli.main(['disttrain', *args])
          code = 0
        except SystemExit as e:
          code = e.code if isinstance(e.code, int) else 0
        sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
      os.close(write)
      with os.fdopen(read) as pipe:
        text = pipe.read()
      out[' '.join(args)] = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), text]
    print(json.dumps(out))
""")
# A flag only this subcommand's program has: its --help names it and no other program's.
OWN_FLAG = {'train': '--coordinator_address', 'check': '--check', 'batch-size': '--memory_limit',
            'supervise': '--max_restarts',
            'cluster': '--devices_per_process', 'export': '--dtype', 'generate': '--temperature',
            'lm-eval': '--include_path', 'compare': '--max_kl',
            'convert': '--source', 'tokenizer': '--vocab_size', 'plot': '--metrics',
            'goodput': '--json: Also write the report'}  # generate has a --json of its own


def _forked(commands: list[list[str]]) -> dict[str, list]:
  proc = _run(sys.executable, '-c', _FORKED, json.dumps(commands))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_subcommand_answers_help_with_its_own_flags_and_a_bad_flag_in_one_line():
  runs = _forked([[name, flag] for name in cli.COMMANDS
                  for flag in ('--help', '-h', '--bogus_flag=1')])
  assert set(cli.COMMANDS) == set(OWN_FLAG)
  assert set(runs) == {f'{name} {flag}' for name in cli.COMMANDS
                       for flag in ('--help', '-h', '--bogus_flag=1')}
  for name in cli.COMMANDS:
    code, text = runs[f'{name} --help']
    module = cli.COMMANDS[name][0]
    assert code == 0 and 'Try --helpfull' in text, (name, text[-2000:])  # absl's would exit 1
    assert f'{module.replace(".", "/")}.py:' in text, (name, text[:2000])  # its flags, by file
    assert OWN_FLAG[name] in text, (name, text[:2000])
    assert runs[f'{name} -h'] == [0, text], (name, runs[f'{name} -h'])  # absl has no -h
    others = {flag for other, flag in OWN_FLAG.items() if cli.COMMANDS[other][0] != module}
    assert not [flag for flag in others if f'  {flag}' + ':' * (':' not in flag) in text], (
        name, text[:2000])
    code, text = runs[f'{name} --bogus_flag=1']  # absl alone: a FATAL block, exit 1
    assert code == 2 and text.splitlines()[0].startswith(
        "error: Unknown command line flag 'bogus_flag'; run with --helpfull"), (name, text)
    assert len([line for line in text.splitlines() if line.strip()]) == 1, (name, text)
  # The usage lines keep their `\` continuations (a plain docstring joined them into one line).
  assert '-- \\\n      disttrain cluster --num_processes=2' in runs['supervise --help'][1]


# A subcommand's own flag with a bad value or an output it cannot write: one line, exit 2,
# before any work (the workdir, model and input named here do not even exist).
BAD_FLAGS = [
    (['generate', '--workdir={d}/none', '--prompt=hi', '--fake_devices=-2'],
     '--fake_devices=-2: -2 is not a positive integer; pass one that is'),  # ran on 1 device
    (['tokenizer', '--input={d}/none.txt', '--out={d}/t.json', '--vocab_size=10'],
     '--vocab_size=10: 10 is not integer >= 257'),  # wrote 257 tokens
    (['compare', '--hf_dir={d}/none', '--max_kl=-1'],  # exit 1, a FAIL line
     '--max_kl=-1: -1.0 is not a non-negative number'),
    (['export', '--workdir={d}/none', '--out={d}/hf', '--max_shard_gb=0'],  # a file per tensor
     '--max_shard_gb=0 must be > 0'),
    (['generate', '--workdir={d}/none', '--prompt=hi', '--json={d}'],  # after sampling
     "--json='{d}' is a directory; pass a file path in it"),
    (['compare', '--hf_dir={d}/none', '--json={d}'], "--json='{d}' is a directory"),
    (['compare', '--workdir={d}/none', '--hf_dir={d}/nope'],  # loaded the run, asked the Hub
     "--hf_dir='{d}/nope' is not a Hugging Face model directory"),
    (['tokenizer', '--input={d}/none.txt', '--out={d}'], "--out='{d}' is a directory"),
    (['convert', '--source=digits', '--out={d}/a_file'],  # FileExistsError tracebacks
     "--out='{d}/a_file' is a file; pass a folder"),
    (['export', '--workdir={d}/none', '--out={d}/a_file'], "--out='{d}/a_file' is a file"),
    # The config layer's fixes, spoken in the command's flags (they named --config.data.*).
    (['convert', '--source=mnist', '--out={d}/out'], 'pass --data_dir=PATH'),
    (['convert', '--source=digits', '--eval_examples=100000', '--out={d}/out'],
     'pass --eval_examples=N with N < 1797'),
    (['tokenizer', '--input={d}/a_file.jsonl', '--out={d}/t.json'],
     "no field 'text' (it has ['body']); set the field name (--text_field)"),
]


def test_bad_values_of_a_subcommands_flags_are_one_line_before_any_work(tmp_path):
  (tmp_path / 'a_file').write_text('not a folder')
  (tmp_path / 'a_file.jsonl').write_text('{"body": "a document"}\n')
  commands = [[a.replace('{d}', str(tmp_path)) for a in args] for args, _ in BAD_FLAGS]
  runs, wrong = _forked(commands), []
  for args, (_, want) in zip(commands, BAD_FLAGS):
    code, text = runs[' '.join(args)]
    lines = [line for line in text.splitlines() if line.strip()]
    if not (code == 2 and len(lines) == 1 and lines[0].startswith('error: ') and
            want.replace('{d}', str(tmp_path)) in lines[0]):
      wrong.append((args[:2], code, text[-300:]))
  assert not wrong, wrong
  assert sorted(p.name for p in tmp_path.iterdir()) == ['a_file', 'a_file.jsonl']  # no output


def test_old_module_paths_are_the_same_modules_with_a_warning_at_the_callers_line():
  from disttrain.data import records  # pylint: disable=g-import-not-at-top
  from disttrain.training import loop  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    import disttrain.records as old_records  # pylint: disable=g-import-not-at-top
    from disttrain.loop import train  # pylint: disable=g-import-not-at-top
    from disttrain import data  # pylint: disable=g-import-not-at-top
    batch_sharding = data.batch_sharding
    from disttrain.training.setup import preflight  # pylint: disable=g-import-not-at-top
    from disttrain.data import sources  # pylint: disable=g-import-not-at-top
    text_files = sources.text_files
    from disttrain.data import batches  # pylint: disable=g-import-not-at-top
    old_local_rows = batches.local_rows
    from disttrain.parallel import step  # pylint: disable=g-import-not-at-top
    old_micro_batches = step.micro_batches
    from disttrain.models import decoder  # pylint: disable=g-import-not-at-top
    old_language_model = decoder.LanguageModel
  assert old_records is records and train is loop.train
  from disttrain.parallel import mesh  # pylint: disable=g-import-not-at-top
  from disttrain.data import in_memory  # pylint: disable=g-import-not-at-top
  from disttrain.training import memory  # pylint: disable=g-import-not-at-top
  from disttrain.data import global_arrays  # pylint: disable=g-import-not-at-top
  from disttrain.parallel import accumulation  # pylint: disable=g-import-not-at-top
  assert batch_sharding is mesh.batch_sharding and old_local_rows is global_arrays.local_rows
  assert old_micro_batches is accumulation.micro_batches
  from disttrain.models import language_model  # pylint: disable=g-import-not-at-top
  assert old_language_model is language_model.LanguageModel
  assert preflight is memory.preflight and text_files is in_memory.text_files
  moved = [w for w in caught if issubclass(w.category, DeprecationWarning)]
  assert [str(w.message).split(';')[0] for w in moved] == [
      'disttrain.records moved to disttrain.data.records',
      'disttrain.loop moved to disttrain.training.loop',
      'disttrain.data.batch_sharding moved to disttrain.parallel.mesh.batch_sharding',
      'disttrain.training.setup.preflight moved to disttrain.training.memory.preflight',
      'disttrain.data.sources.text_files moved to disttrain.data.in_memory.text_files',
      'disttrain.data.batches.local_rows moved to disttrain.data.global_arrays.local_rows',
      'disttrain.parallel.step.micro_batches moved to disttrain.parallel.accumulation.micro_batches',
      'disttrain.models.decoder.LanguageModel moved to '
      'disttrain.models.language_model.LanguageModel']
  assert {w.filename for w in moved} == {__file__}, [(w.filename, w.lineno) for w in moved]


def test_an_old_python_m_spelling_runs_the_tool_and_names_the_new_one_once(tmp_path):
  _log(tmp_path)
  old = _run(sys.executable, '-m', 'disttrain.goodput', str(tmp_path))
  new = _run(str(SCRIPT), 'goodput', str(tmp_path))
  assert old.returncode == new.returncode == 0, old.stderr + new.stderr
  assert old.stdout == new.stdout and 'goodput 66.7%' in new.stdout
  assert new.stderr == ''
  assert old.stderr.splitlines() == ['note: `python -m disttrain.goodput` is now `disttrain '
                                     'goodput` (same flags); the old spelling still works for now']

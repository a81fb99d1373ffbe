"""The launcher as a user runs it: one-line errors for bad input, and the outputs contract.

Every test runs the launcher as a process of its own (one at a time), on tiny configs: bad input
through `python launch/train.py` (each a fork of a process with its libraries imported:
tests/forked_launcher.py), the outputs' run through the installed `disttrain train`.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env

CONFIG = 'launch/configs/mnist_mlp.py'
TINY = ('--config.num_train_steps=4', '--config.model.hidden=32', '--config.global_batch_size=16')
DIGITS_EVAL = 297  # the held-out digits split


def _env() -> dict:
  """The launcher decides the device count itself (--fake_devices), not conftest's XLA_FLAGS."""
  return subprocess_env()


def launch(*args: str, timeout: float = 120, script: bool = True) -> subprocess.CompletedProcess:
  """`python launch/train.py ARGS`, or with script=False `disttrain train ARGS` (pip's script)."""
  command = [sys.executable, 'launch/train.py'] if script else [
      os.path.join(os.path.dirname(sys.executable), 'disttrain'), 'train']
  return subprocess.run([*command, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=timeout, check=False)


# ----------------------------------------------------------------------------------------------
# Bad input: exit status 2, exactly one `error:` line naming the value, the rule and the fix.

# (id, args after --config/--workdir, substrings the line must contain, regex for the fix).
# '{dir}' in an argument is replaced by a folder of prepared bad data (see `bad_data`).
BAD_INPUTS = [
    ('mesh_product', ['--fake_devices=8', '--config.mesh.data=3'],
     ['data=3', '8 are present'], r'make the product 8 or set one axis to -1'),
    ('mesh_two_fill_axes', ['--fake_devices=8', '--config.mesh.data=-1', '--config.mesh.fsdp=-1'],
     ["'data': -1", "'fsdp': -1", 'more than one -1'], r'give at most one axis -1'),
    ('mesh_fill_not_divisible', ['--fake_devices=8', '--config.mesh.fsdp=3'],
     ['fsdp=3', 'not divisible by 3'], r'make the fixed axes divide 8'),
    ('mesh_axis_zero', ['--fake_devices=8', '--config.mesh.data=0'],
     ['mesh.data=0', 'must be >= 1 or -1'], r'>= 1 or -1'),
    ('batch_not_divisible', ['--fake_devices=8', '--config.global_batch_size=100'],
     ['global_batch_size=100', 'not divisible', '8 devices'], r'use a multiple of 8'),
    ('eval_batch_not_divisible', ['--fake_devices=8', '--config.eval_batch_size=12'],
     ['eval_batch_size=12', 'not divisible'], r'use a multiple of 8'),
    ('unknown_field', ['--fake_devices=8', '--config.no_such_field=1'],
     ['unknown config field no_such_field', '--config.no_such_field=1', 'global_batch_size'],
     r'use one of them'),
    ('unknown_nested_field', ['--fake_devices=8', '--config.mesh.nope=2'],
     ['unknown config field mesh.nope', 'context, data, expert, fsdp, stage, tensor'],
     r'use one of them'),
    ('field_of_a_value', ['--config.mesh.data.x=2'],
     ['mesh.data', "'x'"], r'set --config\.mesh\.data=<value>'),
    ('value_for_a_group', ['--config.mesh=3'],
     ['--config.mesh=', 'group of fields'], r'set its fields'),
    ('pmap_fsdp', ['--fake_devices=8', '--config.step_mode=pmap', '--config.mesh.fsdp=2'],
     ['step_mode=pmap', 'mesh.fsdp=2', 'data parallel only'], r'use step_mode=jit'),
    # dcn_mesh's part of an axis counts (these were accepted; shard_map then ran no pipeline).
    ('dcn_stage_shard_map', ['--config.step_mode=shard_map', '--config.dcn_mesh.stage=2',
                             '--config.grad_accum_steps=2'],
     ['mesh.stage=1 x dcn_mesh.stage=2 pipelines layers inside the jit step'],
     r'use step_mode=jit'),
    ('dcn_stage_micro_batches', ['--config.dcn_mesh.stage=4'],
     ['mesh.stage=1 x dcn_mesh.stage=4 needs at least as many micro-batches as stages'],
     r'set grad_accum_steps >= 4'),
    ('pmap_tensor', ['--fake_devices=8', '--config.step_mode=pmap', '--config.mesh.tensor=2'],
     ['step_mode=pmap', 'mesh.tensor=2', 'data parallel only'], r'use step_mode=jit'),
    ('mnist_without_dir', ['--fake_devices=8', '--config.data.name=mnist'],
     ["data.name='mnist'", 'data.dir'], r'pass --config\.data\.dir='),
    ('mnist_dir_missing', ['--fake_devices=8', '--config.data.name=mnist',
                           '--config.data.dir={dir}/missing'],
     ['missing', 'does not exist'], r'pass --config\.data\.dir='),
    ('mnist_malformed_images', ['--fake_devices=8', '--config.data.name=mnist',
                                '--config.data.dir={dir}/malformed'],
     ['t10k-images-idx3-ubyte', 'bad magic number'], r'replace it'),
    ('mnist_pair_incomplete', ['--fake_devices=8', '--config.data.name=mnist',
                               '--config.data.dir={dir}/half'],
     ['t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'], r'add the missing file'),
    # The message names the files that must be there but no imperative (see data/in_memory.py).
    ('mnist_dir_empty', ['--fake_devices=8', '--config.data.name=mnist',
                         '--config.data.dir={dir}/empty'],
     ['empty', 'no MNIST files'], r'put t10k-images-idx3-ubyte'),
    ('unknown_data_name', ['--fake_devices=8', '--config.data.name=imagenet'],
     ["data.name='imagenet'", 'digits'], r'pick one of them'),
    ('unknown_model_name', ['--fake_devices=8', '--config.model.name=resnet'],
     ["model.name='resnet'", 'mnist_mlp'], r'pick one of them'),
    ('logical_rule_missing_axis',
     ['--fake_devices=8', "--config.logical_rules=(('hidden','nope'),)"],
     ["'nope'", "logical_rules 'hidden'", 'mesh axis'], r'use one of them or None'),
    ('param_rule_missing_axis', ['--fake_devices=8',
                                 "--config.param_rules=(('Dense_0/kernel', (None, 'bogus')),)"],
     ["'bogus'", "param_rules 'Dense_0/kernel'", 'mesh axis'], r'use one of them or None'),
    ('param_rule_bad_regex',
     ['--fake_devices=8', "--config.param_rules=(('Dense_[0/kernel', (None, 'tensor')),)"],
     ["param_rules regex 'Dense_[0/kernel'", 'does not compile'], r'fix it'),
    # Fields that would be ignored: files of a source that reads none, sgd's momentum with adam,
    # early stopping with evals at the end only, a llama3 rope scaling with no original length.
    ('files_of_a_fileless_source', ['--config.data.train_files=/nonexistent/x.bin'],
     ["data.name='digits' reads no data.train_files"], r'drop them'),
    ('harness_limit_without_harness', ['--config.data.eval_harness_limit=5'],  # ignored
     ['data.eval_harness_limit=5 applies to data.eval_harness tasks, and none is named'],
     r'set data\.eval_harness=TASK'),
    ('exhausted_without_mixture', ['--config.data.mixture_exhausted=stop'],  # repeated epochs
     ["data.mixture_exhausted='stop' applies to data.mixture sources"], r'set data\.mixture'),
    ('lora_field_without_rank', ['--config.lora.alpha=32'],  # every weight trained
     ['lora.alpha=32.0 applies with lora.rank > 0, which this run does not set'],
     r'set it or drop the field'),
    ('grpo_eval_files', ['--config=launch/configs/grpo_sums.py',
                         '--config.data.eval_files={dir}/pairs.jsonl'],  # dropped silently
     ["data.eval_files='", "pairs.jsonl' with data.name='prompts': GRPO has no eval split"],
     r'drop data\.eval_files'),
    ('momentum_without_sgd', ['--config.optimizer=adam', '--config.momentum=0.9'],
     ["momentum=0.9", "optimizer='sgd' only"], r'set b1'),
    # A job that could never start: a traceback the supervisor restarted, or the init timeout.
    ('coordinator_without_port', ['--coordinator_address=localhost', '--num_processes=2',
                                  '--process_id=0'],
     ["--coordinator_address='localhost' is not host:port"], r'10\.0\.0\.1:8476'),
    ('coordinator_port_65535', ['--coordinator_address=10.0.0.1:65535', '--num_processes=2',
                                '--process_id=0'],  # an OverflowError traceback at the roll call
     ["--coordinator_address='10.0.0.1:65535': the port must be in 1..65534"], r'10\.0\.0\.1:8476'),
    ('process_id_out_of_range', ['--coordinator_address=127.0.0.1:1234', '--num_processes=2',
                                 '--process_id=5'],
     ['--process_id=5 must be in 0..1'], r'--num_processes=2'),
    ('early_stop_without_evals', ['--config.early_stop.metric=eval/accuracy',
                                  '--config.eval_every_steps=0'],
     ['early_stop.metric', 'eval_every_steps=0'], r'set eval_every_steps > 0'),
    ('rope_original_len', ['--config.model.rope_scaling.original_max_len=0'],
     ['model.rope_scaling.original_max_len'], r'> 0'),
    ('deprecated_and_new_name', ['--config.data.synthetic_examples=10',
                                 '--config.data.synthetic.examples=20'],
     ['data.synthetic_examples=10 (deprecated) and data.synthetic.examples=20 are both set'],
     r'drop data\.synthetic_examples'),  # the deprecated value silently won
    # `disttrain check` parses what setup would (it printed ok for these).
    ('check_mixture', ['--check', '--config.data.name=tokens', '--config.data.mixture=garbage'],
     ["data.mixture entry 'garbage' is not NAME=GLOB:WEIGHT"], r'write e\.g\.'),
    ('check_batch_split', ['--check', '--config.global_batch_size=8',
                           '--config.grad_accum_steps=3'],  # 'ok', then refused by train
     ['global_batch_size=8 does not split into grad_accum_steps=3'], r'use a multiple of 3'),
    ('check_filled_batch_split', ['--check', '--fake_devices=8', '--config.global_batch_size=100'],
     ['global_batch_size=100 is not divisible by the 8 devices'],  # data=-1 fills 8 here
     r'use a multiple of 8'),
    ('finder_flag_in_train', ['--memory_limit=1000'],  # ignored: no limit was applied
     ['--memory_limit applies to `disttrain batch-size`'], r'--config\.memory_limit_bytes'),
    ('check_eval_tasks', ['--check', "--config.data.eval_tasks=a=x.jsonl;a=y.jsonl"],
     ["data.eval_tasks names 'a' twice"], r'give each task its own name'),
    ('param_rule_too_many_dims',
     ['--fake_devices=8', "--config.param_rules=(('Dense_0/kernel', (None, 'tensor', 'data')),)"],
     ['ShardingError', 'Dense_0/kernel', 'spec of 3 dims'], r'give one entry per dimension'),
    ('context_without_a_language_model',
     ['--fake_devices=8', '--config.mesh.data=4', '--config.mesh.context=2'],
     ['mesh.context=2', 'only the language models do'], r'use mesh.context=1'),
    ('lora_rank_too_large',
     ['--config=launch/configs/llama.py', '--fake_devices=8', '--config.data.text.bytes=20000',
      '--config.data.seq_len=16', '--config.lora.rank=512'],
     ['lora.rank=512', 'blocks/attention/query/kernel', 'smaller side'],
     r'use a smaller lora\.rank'),
    ('lora_targets_match_nothing',
     ['--config=launch/configs/llama.py', '--fake_devices=8', '--config.data.text.bytes=20000',
      '--config.data.seq_len=16', '--config.lora.rank=4', '--config.lora.targets=attn/q_proj'],
     ["lora.targets='attn/q_proj'", 'matches no weight'], r'name some of'),
    ('preference_line_without_rejected',
     ['--config=launch/configs/llama.py', '--fake_devices=8', '--config.data.name=preference',
      '--config.data.train_files={dir}/pairs.jsonl', '--config.data.seq_len=16',
      '--config.model.vocab_size=260'],  # the bytes tokenizer's EOS is id 256
     ['pairs.jsonl line 2', "needs 'chosen' and 'rejected'", "no 'rejected'"],
     r'add it or fix the file'),
    ('grpo_reward_does_not_import',
     ['--config=launch/configs/grpo_sums.py', '--config.grpo.rewards=no_such_module.score'],
     ["grpo.rewards: 'no_such_module.score' does not import", 'ModuleNotFoundError'],
     r'name a module\.function'),
    ('grpo_reward_not_callable',
     ['--config=launch/configs/grpo_sums.py', '--config.grpo.rewards=math.pi'],
     ["grpo.rewards: 'math.pi' is not a callable"], r'name a function'),
    ('grpo_group_of_one', ['--config=launch/configs/grpo_sums.py', '--config.grpo.group_size=1'],
     ['grpo.group_size=1', 'a group of one'], r'sample >= 2 completions'),
    ('stage_not_dividing_layers',
     ['--config=launch/configs/gpt.py', '--fake_devices=8', '--config.mesh.data=1',
      '--config.mesh.stage=8', '--config.grad_accum_steps=8'],
     ['model.num_layers=4', 'mesh.stage=8'], r'use a stage count that divides 4'),
    ('stage_with_fewer_micro_batches', ['--fake_devices=8', '--config.mesh.stage=2'],
     ['mesh.stage=2', 'grad_accum_steps=1'], r'set grad_accum_steps >= 2'),
    ('stage_with_pmap', ['--fake_devices=8', '--config.mesh.stage=2', '--config.grad_accum_steps=2',
                         '--config.step_mode=pmap'],
     ['mesh.stage=2', 'step_mode=pmap'], r'use step_mode=jit'),
    ('wrong_type_int', ['--config.global_batch_size=abc'],
     ["--config.global_batch_size='abc'", 'not an int'], r'pass an int'),
    ('wrong_type_float', ['--config.learning_rate=fast'],
     ["--config.learning_rate='fast'", 'not a float'], r'pass a float'),
    ('fake_devices_zero', ['--fake_devices=0'],
     ['--fake_devices=0', 'must be >= 1'], r'pass a device count'),
    ('fake_devices_not_int', ['--fake_devices=abc'],
     ["--fake_devices='abc'", 'not an int'], r'pass an int'),
    ('unknown_flag', ['--fake_device=8'],
     ["'fake_device'", 'Did you mean: fake_devices'], r'run with --helpfull'),
    ('positional_argument', ['--fake_devices=8', 'mesh.data=8'],
     ["'mesh.data=8'", 'unexpected arguments'], r'pass settings as flags'),
    ('override_before_config', ['--config.mesh.data=2', f'--config={CONFIG}'],
     ['--config.mesh.data=2', 'before a value for --config'], r'put --config=FILE first'),
    ('config_file_missing', ['--config=launch/configs/no_such_config.py'],
     ['no_such_config.py', 'cannot be loaded'], r'pass --config=PATH'),
    ('workdir_under_a_file', ['--workdir={dir}/a_file/run'],
     ['a_file/run', 'a_file is a file, not a directory'], r'pass a directory'),
    ('workdir_empty', ['--workdir='],  # --workdir=$UNSET: never the current directory
     ["--workdir='' is empty"], r'pass --workdir=DIR'),
    ('workdir_uppercase_scheme', ['--workdir=S3://bucket/run'],
     ["'S3://bucket/run'", 'lowercase'], r's3://'),
    ('config_without_get_config', ['--config=launch/train.py'],  # an AttributeError traceback
     ["--config='launch/train.py' defines no get_config()"], r'e\.g\. --config='),
    ('checkpoints_is_a_file', ['--workdir={dir}/run_with_a_file'],  # NotADirectoryError trace
     ['run_with_a_file/checkpoints is a file'], r'move it aside'),
    ('learning_rate_nan', ['--check', '--config.learning_rate=nan'],  # 'ok', then a NaN loss
     ['learning_rate=nan is not a finite number'], r'pass a value >= 0'),
    ('seed_over_64_bits', ['--config.seed=9223372036854775808'],  # an OverflowError traceback
     ['seed=9223372036854775808 does not fit in 64 bits'], r'below 2\*\*63'),
    ('gpt_positions_shorter_than_rows',  # trained to a NaN loss, "lower learning_rate"
     ['--check', '--config=launch/configs/gpt.py', '--config.data.seq_len=16',
      '--config.model.max_seq_len=8'],
     ['model.max_seq_len=8', 'shorter than the rows of 16 tokens'], r'raise it to >= 16'),
    ('shipped_config_unknown_size', ['--config=launch/configs/llama.py:huge'],  # KeyError trace
     ["no size 'huge' in launch/configs/llama.py"], r'pick one of tiny, smollm2_135m'),
]


@pytest.fixture
def bad_data(tmp_path):
  """Folders of bad MNIST data, and a plain file where a folder is expected."""
  malformed = tmp_path / 'malformed'  # both files, the images one garbage
  malformed.mkdir()
  (malformed / 't10k-images-idx3-ubyte').write_bytes(b'this is not an IDX file')
  (malformed / 't10k-labels-idx1-ubyte').write_bytes(
      (0x801).to_bytes(4, 'big') + (3).to_bytes(4, 'big') + bytes([1, 2, 3]))
  half = tmp_path / 'half'  # images only: the labels file of the pair is missing
  half.mkdir()
  (half / 't10k-images-idx3-ubyte').write_bytes(b'this is not an IDX file')
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'a_file').write_text('not a folder')
  (tmp_path / 'run_with_a_file').mkdir()
  (tmp_path / 'run_with_a_file' / 'checkpoints').write_text('not a folder')
  (tmp_path / 'pairs.jsonl').write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                                        '{"prompt": "a", "chosen": "b"}\n')
  return tmp_path


@pytest.mark.parametrize('args,needles,fix', [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_error(args, needles, fix, bad_data, tmp_path, launcher):
  args = [a.replace('{dir}', str(bad_data)) for a in args]
  workdir = [] if any(a.startswith('--workdir') for a in args) else [f'--workdir={tmp_path / "w"}']
  if any(a.startswith('--config=') for a in args):  # its own --config, where it puts it
    result = launcher.run(*args, *workdir, *TINY)
  else:  # the case's overrides last, so they win over TINY's
    result = launcher.run(f'--config={CONFIG}', *workdir, *TINY, *args)
  output = result.stdout + result.stderr
  assert 'Traceback' not in output, output
  assert result.returncode == 2, output
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, f'expected one error line, got:\n{result.stderr}'
  line = lines[0]
  assert line.startswith('error: '), line
  for needle in needles:
    assert needle in line, f'{needle!r} not in {line!r}'
  assert re.search(fix, line), f'no fix ({fix!r}) in {line!r}'
  assert not (tmp_path / 'w' / 'metrics.jsonl').exists(), 'a bad run must not start training'


# ----------------------------------------------------------------------------------------------
# Outputs: metrics.jsonl, run.json, TensorBoard events, console lines.


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """One tiny run on 8 fake devices (`disttrain train`): train and eval records every 2 of 4
  steps."""
  workdir = tmp_path_factory.mktemp('run')
  result = launch(f'--config={CONFIG}', f'--workdir={workdir}', '--fake_devices=8', *TINY,
                  '--config.log_every_steps=2', '--config.eval_every_steps=2', script=False)
  assert result.returncode == 0, result.stdout + result.stderr
  return workdir, result


def _finite_float(value) -> bool:
  return isinstance(value, float) and math.isfinite(value)


def test_metrics_jsonl(run):
  workdir, _ = run
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  train = [r for r in records if r['split'] == 'train']
  evals = [r for r in records if r['split'] == 'eval']
  assert len(train) + len(evals) == len(records), records
  assert [r['step'] for r in train] == [2, 4]
  assert [r['step'] for r in evals] == [2, 4]
  for r in train:
    for key in ('loss', 'learning_rate', 'examples_per_sec'):
      assert _finite_float(r[key]), (key, r)
    assert r['examples_per_sec'] > 0 and r['learning_rate'] > 0, r
  for r in evals:
    assert _finite_float(r['loss']) and _finite_float(r['accuracy']), r
    assert 0.0 <= r['accuracy'] <= 1.0, r
    assert r['num_examples'] == DIGITS_EVAL, r
  for split in (train, evals):  # strictly increasing steps per split
    steps = [r['step'] for r in split]
    assert all(a < b for a, b in zip(steps, steps[1:])), steps


def test_run_json(run):
  workdir, _ = run
  info = json.loads((workdir / 'run.json').read_text())
  for key in ('mesh', 'sharding', 'step_mode', 'data', 'model', 'global_batch_size'):
    assert key in info['config'], key
  assert info['config']['global_batch_size'] == 16
  assert info['mesh'] == {'data': 8, 'stage': 1, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1}
  assert info['num_devices'] == 8
  assert info['num_processes'] == 1
  assert info['step_mode'] == 'jit'
  specs = info['param_specs']
  assert 'Dense_0/kernel' in specs and 'Dense_2/bias' in specs, specs
  assert all(isinstance(spec, list) for spec in specs.values()), specs
  assert all('fsdp' not in json.dumps(spec) for spec in specs.values()), specs
  assert info['param_split'] == {'axes': [], 'split': 0, 'arrays': len(specs)}


def test_tensorboard_events(run):
  workdir, _ = run
  events = list(workdir.glob('events.out.tfevents.*'))
  assert events and events[0].stat().st_size > 0, list(workdir.iterdir())


def test_console_lines(run):
  _, result = run
  lines = result.stdout.splitlines()
  progress = [l for l in lines if re.fullmatch(
      r'train step \d+/4: loss \d+\.\d+ [\d,]+ examples/s, ETA \S+', l)]
  assert len(progress) == 2, result.stdout
  summary = [l for l in lines if 'final eval accuracy' in l]
  assert len(summary) == 1 and summary[0] == lines[-1], result.stdout
  assert re.search(r'final eval accuracy \d\.\d+', summary[0]), summary[0]
  assert f'({DIGITS_EVAL} examples)' in summary[0], summary[0]
  assert 'Traceback' not in result.stdout + result.stderr
  (start,) = [l for l in lines if l.startswith('disttrain: 8 devices')]
  assert 'step_mode=jit, params replicated, data=digits' in start, start


@pytest.mark.slow
def test_run_json_fsdp_specs(tmp_path):
  """With sharding=fsdp the kernels of at least fsdp_min_size elements are split over 'fsdp'."""
  result = launch(f'--config={CONFIG}', f'--workdir={tmp_path}', '--fake_devices=8', *TINY,
                  '--config.num_train_steps=1', '--config.mesh.data=1', '--config.mesh.fsdp=8',
                  '--config.sharding=fsdp', '--config.fsdp_min_size=1000')
  assert result.returncode == 0, result.stdout + result.stderr
  info = json.loads((tmp_path / 'run.json').read_text())
  assert info['mesh'] == {'data': 1, 'stage': 1, 'fsdp': 8, 'expert': 1, 'context': 1, 'tensor': 1}
  specs = info['param_specs']
  # hidden=32 on 8x8 digits: Dense_0 (64, 32) = 2048 and Dense_1 (32, 32) = 1024 elements are
  # split; Dense_2 (32, 10) = 320 and the biases stay whole.
  assert 'fsdp' in specs['Dense_0/kernel'], specs
  assert 'fsdp' in specs['Dense_1/kernel'], specs
  assert 'fsdp' not in specs['Dense_2/kernel'], specs
  assert 'fsdp' not in specs['Dense_0/bias'], specs
  assert any(line.startswith('Dense_2/kernel') for line in info['fsdp_replicated']), info
  assert info['param_split'] == {'axes': ['fsdp'], 'split': 2, 'arrays': 10}  # BatchNorms too
  assert 'params split over fsdp (2 of 10 arrays)' in result.stdout


def test_a_flagfile_gives_the_config_and_its_overrides(tmp_path, launcher):
  flagfile = tmp_path / 'flags.txt'  # absl expands it; the config file's hooks are found from it
  flagfile.write_text(f'--config={CONFIG}\n--config.num_train_steps=3\n')
  result = launcher.run(f'--flagfile={flagfile}', f'--workdir={tmp_path}', '--check')
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(f'ok: --config={CONFIG} builds a valid config'), result.stdout
  assert '3 steps' in result.stdout, result.stdout
  # A process of a 2 x 4 cluster checks the mesh over the job's 8 devices, not its own 4.
  result = launcher.run(f'--flagfile={flagfile}', f'--workdir={tmp_path}', '--check',
                        '--fake_devices=4', '--num_processes=2', '--config.mesh.data=2',
                        '--config.mesh.fsdp=4')
  assert result.returncode == 0, result.stderr


def test_a_malformed_process_count_in_the_environment_is_one_line(tmp_path, launcher):
  result = launcher.run(f'--config={CONFIG}', f'--workdir={tmp_path}', '--check',
                        env={'JAX_NUM_PROCESSES': 'two'})  # it was ignored: a 1-process run
  assert result.returncode == 2, result.stderr
  assert result.stderr.splitlines() == [
      "error: JAX_NUM_PROCESSES='two' is not a number; set it to a count such as 2, or unset it "
      '(--num_processes=N overrides it)']


@pytest.mark.parametrize('flag', ['config', 'workdir'])
def test_missing_required_flag_is_one_line_error(flag, tmp_path, launcher):
  given = {'config': f'--config={CONFIG}', 'workdir': f'--workdir={tmp_path}'}
  del given[flag]
  result = launcher.run(*given.values())
  assert 'Traceback' not in result.stdout + result.stderr
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines() == [f'error: --{flag} is required; pass --{flag}='
                                                f'{CONFIG if flag == "config" else "DIR"}']

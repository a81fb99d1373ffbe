"""The batch-size finder (disttrain/training/batch_size.py, `disttrain batch-size`): between the
compiled sizes of micro-batch b and 2b, measured here from XLA's memory analysis, it picks b, b
passes the memory pre-flight and 2b does not; the search against brute force; bad input is one
line and exit 2."""

import dataclasses
import subprocess
import sys

import pytest

from disttrain import config as config_lib
from disttrain.data import records as records_lib, sources
from disttrain.data.batches import element_spec
from disttrain.parallel.step import Variant
from disttrain.training import batch_size, memory, setup as run_lib
from tests import helpers
from tests.conftest import ROOT, subprocess_env

LLAMA = ROOT / 'launch' / 'configs' / 'llama.py'
# The tiny Llama cut to one narrow layer on 32-token rows: cheap compiles whose memory still grows
# with the batch. One train step, so the loop compiles one variant ('logged').
SMALL = {'model.num_layers': 1, 'model.hidden': 32, 'model.mlp_dim': 64, 'data.seq_len': 32,
         'data.text.bytes': 40000, 'data.eval_examples': 8, 'mesh.data': 1,
         'eval_batch_size': 0, 'num_train_steps': 1, 'warmup_steps': 0}
ARGS = [f'--config={LLAMA}', '--fake_devices=1', *(f'--config.{k}={v}' for k, v in SMALL.items())]


def _config(**overrides) -> config_lib.Config:
  cd = helpers.config_file(LLAMA)
  return config_lib.from_config_dict(helpers.override(cd, {**SMALL, **overrides}))


def _peak(plan: run_lib.Plan) -> int:
  """Per-device bytes of the plan's train step, from jax's memory analysis of our own compile:
  arguments + outputs not written over the donated arguments + temporaries."""
  lowered = plan.steps.make_train(Variant(full_batch=True)).lower(
      plan.state, memory.train_batch_spec(plan))
  m = lowered.compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


@pytest.mark.slow  # ~11 s of compiles; the quick tier keeps the search against brute force
def test_the_finder_picks_b_between_the_sizes_of_b_and_2b_and_only_b_passes_the_preflight():
  cfg = _config(global_batch_size=2)
  spec = element_spec(records_lib.Records(sources.build(cfg)['train_data'], 'train', cfg.seed))
  plans = {b: run_lib.plan(dataclasses.replace(cfg, global_batch_size=b), spec, helpers.devices(1))
           for b in (2, 4)}
  sizes = {b: _peak(plan) for b, plan in plans.items()}
  assert sizes[2] < sizes[4], sizes
  limit = (sizes[2] + sizes[4]) // 2

  # Through the headroom: a limit at which 4 would fit, less a headroom that leaves `limit`.
  given = sizes[4] + 1
  headroom = 1 - limit / given
  found = batch_size.find(cfg, limit=given, headroom=headroom, devices=helpers.devices(1))
  assert found.micro_batch == 2 and found.global_batch_size == 2
  assert abs(found.budget_bytes - limit) <= 1, (found.budget_bytes, limit)
  assert found.tried == sizes  # the bytes our own compiles measured: 2 fits, 4 does not
  assert found.peak_bytes == sizes[2] < found.budget_bytes < sizes[4] < given

  # The configured batch of 4 at a limit micro-batch 2 fits but not its accumulated step (its
  # gradient accumulator): grad_accum_steps=2 was named from the micro-batch, then refused.
  accumulated = dataclasses.replace(cfg, global_batch_size=4, grad_accum_steps=2)
  sizes[(2, 2)] = _peak(run_lib.plan(accumulated, spec, helpers.devices(1)))
  assert sizes[2] < sizes[(2, 2)], sizes
  found = batch_size.find(dataclasses.replace(cfg, global_batch_size=4), headroom=0,
                          limit=(sizes[2] + sizes[(2, 2)]) // 2, devices=helpers.devices(1))
  assert found.micro_batch == 2 and found.keep in (0, 4), found.keep
  said = [line for line in found.lines() if line.startswith('global_batch_size=4 as configured')]
  assert len(said) == 1 and ('fits with --config.grad_accum_steps=4' in said[0]) == bool(
      found.keep), said

  for b, plan in plans.items():
    plan.cfg = dataclasses.replace(plan.cfg, memory_limit_bytes=limit)
    variants = memory.loop_variants(plan.cfg, 0)
    if b == 2:
      memory.preflight(plan, plan.state, variants, lambda _: None)
    else:
      with pytest.raises(memory.MemoryLimitError, match='train step logged needs'):
        memory.preflight(plan, plan.state, variants, lambda _: None)


@pytest.mark.parametrize('multiple', [0, 1, 3, 8])
@pytest.mark.parametrize('start', [1, 16, 1024])
def test_search_finds_the_largest_candidate_that_fits(start, multiple):
  """Against brute force over the candidates: the largest fitting power of two p (at most
  `most`), and with `multiple` the largest fitting multiple of it below 2p."""
  most = 4096
  for budget in (10, 1_036, 1_037, 5_000, 40_000, 10**9):
    need = lambda b: 1_000 + 37 * b  # pylint: disable=cell-var-from-loop
    calls = []

    def fits(b):
      calls.append(b)
      return need(b) <= budget  # pylint: disable=cell-var-from-loop

    powers = [2**k for k in range(13) if 2**k <= most and need(2**k) <= budget]
    p = max(powers, default=0)
    expected = p
    if multiple and p and 2 * p <= most:
      expected = max([p] + [k * multiple for k in range(1, 2 * p // multiple + 1)
                            if k * multiple < 2 * p and need(k * multiple) <= budget])
    assert batch_size.search(fits, start, most, multiple) == expected, (budget, calls)
    assert len(calls) == len(set(calls)) and len(calls) <= 26, calls  # few compiles


def _launch(*args: str) -> subprocess.CompletedProcess:
  env = subprocess_env()
  return subprocess.run([sys.executable, 'launch/train.py', '--find_batch_size', *ARGS, *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                        check=False)


def test_a_mixture_is_read_as_the_run_reads_it_and_pmap_is_refused(tmp_path):
  """A data.mixture config was 'the train data (Mixture) has no __len__' (a run trains it);
  step_mode=pmap was a pjit sharding traceback (its steps take a placed state)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  for name in ('web', 'code'):
    np.arange(4000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(tmp_path / f'{name}.bin')
  mixed = _config(**{'data.name': 'tokens', 'data.eval_examples': 0, 'global_batch_size': 1,
                     'data.mixture': f'web={tmp_path}/web.bin:0.7;code={tmp_path}/code.bin:0.3'})
  with pytest.raises(memory.MemoryLimitError, match='micro-batch 1 per device needs'):
    batch_size.find(mixed, limit=1000, devices=helpers.devices(1))  # compiled: the data read
  with pytest.raises(config_lib.ConfigError, match='step_mode=pmap: the finder compiles jit'):
    batch_size.find(_config(step_mode='pmap'), limit=10**9, devices=helpers.devices(1))


@pytest.mark.slow  # a launcher subprocess, ~5 s
def test_bad_input_is_one_line_and_exit_2():
  # CPU devices report no memory limit, and none is given: the finder's ConfigError, here in
  # process (a second launch cost ~4 s); the launch below shows its error is one line, exit 2.
  with pytest.raises(config_lib.ConfigError, match=r'^no per-device memory limit to fit: the cpu '
                     r'devices report none; pass --memory_limit=BYTES \(or '
                     r'--config.memory_limit_bytes=BYTES\)$'):
    batch_size.find(_config(global_batch_size=1), devices=helpers.devices(1))
  # A limit below what a micro-batch of 1 needs.
  proc = _launch('--config.global_batch_size=1', '--memory_limit=100000', '--headroom=0')
  lines = proc.stderr.splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr
  assert lines[0].startswith('error: MemoryLimitError: micro-batch 1 per device needs ')
  assert 'less 0% headroom' in lines[0] and 'model.remat=full' in lines[0], lines[0]
  assert 'micro-batch 1:' in proc.stdout and 'does not fit' in proc.stdout, proc.stdout

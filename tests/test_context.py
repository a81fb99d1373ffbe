"""Context parallelism: a language model's positions split over mesh.context equal 1 device.

Tolerances as in tests/test_equivalence.py: one step agrees to float reassociation (rtol 1e-5 on
the loss and gradients; the step is SGD at learning rate 1, tests/test_llama.py `_one_step`, so
the gradient check covers the sharded update too, the 10-step test adamw's); over 10 steps bf16
losses to 2e-3 (bf16 rounds partial sums in another order, as in tests/test_llama.py, which also
runs float32's 10 steps). Packed rows (three documents of random lengths per row, padding at the
end) keep their segments apart across the split; the 10-step run uses 2 micro-batches and remat.
The memory test compiles one 16,384-token sequence and reads XLA's memory analysis; nothing runs.
"""

import numpy as np
import pytest

import disttrain
from disttrain import errors
from disttrain.parallel.step import Variant
from disttrain.training import memory
from tests import helpers
from tests.conftest import ROOT
from tests.helpers import assert_trees_close, devices
from tests.test_llama import _one_step

CONFIGS = {'llama': ROOT / 'launch' / 'configs' / 'llama.py',
           'gpt': ROOT / 'launch' / 'configs' / 'gpt.py'}
TINY = {'model.num_layers': 2, 'model.hidden': 64, 'model.num_heads': 4, 'model.mlp_dim': 128,
        'data.seq_len': 32, 'global_batch_size': 8, 'data.text.bytes': 100_000,
        'data.eval_examples': 64, 'eval_batch_size': 64, 'eval_every_steps': 0,
        'model.attention_block': 8}
ONE = {'mesh.data': 1}
LAYOUTS = {'context=8': {'mesh.data': 1, 'mesh.context': 8},
           'data 2 x context 2 x tensor 2': {'mesh.data': 2, 'mesh.context': 2,
                                             'mesh.tensor': 2}}


def _config(name: str, **overrides) -> disttrain.Config:
  cd = helpers.config_file(CONFIGS[name])
  extra = {'model.num_kv_heads': 2} if name == 'llama' else {'model.vocab_size': 256}
  return disttrain.from_config_dict(helpers.override(cd, {**TINY, **extra, **overrides}))


def _packed(rows: int, t: int, vocab: int, seed: int = 0) -> dict:
  """Rows of three documents of random lengths each, then padding (segment 0, target -1)."""
  rng = np.random.default_rng(seed)
  out = {k: np.zeros((rows, t), np.int32) for k in ('tokens', 'segment_ids', 'positions')}
  out['targets'] = np.full((rows, t), -1, np.int32)
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(2, t - 2), 3, replace=False))
    start = 0
    for segment, end in enumerate(cuts, 1):
      n = end - start
      out['tokens'][r, start:end] = rng.integers(0, vocab, n)
      out['targets'][r, start:end - 1] = out['tokens'][r, start + 1:end]
      out['segment_ids'][r, start:end] = segment
      out['positions'][r, start:end] = np.arange(n)
      start = end
  return out


def _check_one_step(name: str, cases):
  """cases: (layout, packed rows?, micro-batches, overrides), each against 1 device (whole
  loss) on the same rows."""
  refs = {}
  for layout, packed, m, overrides in cases:
    train_data = _packed(64, 32, 256) if packed else None
    if packed not in refs:
      refs[packed] = _one_step(_config(name, **ONE), 1, train_data=train_data)
    ref_loss, ref_grads = refs[packed]
    loss, grads = _one_step(_config(name, **LAYOUTS[layout], **overrides), 8, m, train_data)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, 1e-5, 1e-6,
                       f'{name} {layout} gradient and update (M={m})')


@pytest.mark.slow
def test_one_step_with_positions_split_equals_one_device():
  """Llama: packed rows on data 2 x context 2 x tensor 2 with 2 micro-batches and the chunked
  loss (its strided chunks keep a context-split sequence split; the vocabulary stays on
  tensor); GPT (learned positions): packed rows on context=8. The 10-step test below runs causal
  rows on the cube."""
  _check_one_step('llama', [('data 2 x context 2 x tensor 2', True, 2, {'model.loss_chunk': 8})])
  _check_one_step('gpt', [('context=8', True, 1, {})])


def _losses(cfg, workdir, n: int) -> list[float]:
  result = disttrain.train(cfg, str(workdir), devices=devices(n))
  assert result.trace_count == 1
  return [r['loss'] for r in result.records if r['split'] == 'train']


@pytest.mark.slow
@pytest.mark.parametrize('precision,remat,rtol', [('bfloat16', 'full', 2e-3)])
def test_ten_steps_with_positions_split_equal_one_device(tmp_path, precision, remat, rtol):
  common = {'num_train_steps': 10, 'log_every_steps': 1, 'precision.compute_dtype': precision,
            'model.remat': remat}
  reference = _losses(_config('llama', **ONE, **common), tmp_path / 'one', 1)
  split = {**LAYOUTS['data 2 x context 2 x tensor 2'], 'grad_accum_steps': 2}
  np.testing.assert_allclose(_losses(_config('llama', **split, **common), tmp_path / 'split', 8),
                             reference, rtol=rtol)
  assert reference[-1] < reference[0]


def _temp_bytes(cfg, n: int) -> int:
  run = disttrain.setup(cfg, devices=devices(n))
  info = run.steps.compile(Variant(full_batch=True), run.state, memory.train_batch_spec(run))
  return info.temp_bytes


@pytest.mark.slow
def test_one_long_sequence_on_context_eight_needs_a_quarter_of_the_temporaries():
  """One sequence of T = 16,384 per step (data parallelism cannot split it): the compiled
  step's temporaries per device with context=8 against 1 device."""
  long = {'data.seq_len': 16_384, 'global_batch_size': 1, 'data.text.bytes': 40_000,
          'data.eval_examples': 1, 'eval_batch_size': 1, 'model.attention_block': 512,
          'model.num_layers': 1}
  one = _temp_bytes(_config('llama', **ONE, **long), 1)
  split = _temp_bytes(_config('llama', **LAYOUTS['context=8'], **long), 8)
  assert split <= 0.25 * one, (split, one)


@pytest.mark.parametrize('overrides,message', [
    ({'mesh.context': 3, 'mesh.data': 1}, 'sequences of 32 tokens (data.seq_len) do not split '
                                          'over mesh.context=3'),
    ({'mesh.context': 2, 'mesh.data': 4, 'step_mode': 'shard_map'},
     'mesh.context=2 splits sequences inside the jit step, not step_mode=shard_map'),
])
def test_bad_context_settings_are_one_line(overrides, message):
  n = 3 if overrides['mesh.context'] == 3 else 8
  with pytest.raises(errors.ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    disttrain.setup(_config('llama', **overrides), devices=devices(n))


def test_context_with_a_model_that_does_not_split_sequences_is_one_line():
  cfg = helpers.make_config(mesh__data=4, mesh__context=2)
  with pytest.raises(errors.ConfigError, match='only the language models do'):
    disttrain.setup(cfg, devices=devices(8))

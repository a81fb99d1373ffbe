"""Pipeline stages: a language model's layers split over mesh.stage, GPipe over the micro-batches.

Tolerances as in tests/test_equivalence.py and tests/test_context.py: one float32 step agrees to
float reassociation (rtol 1e-5 on the loss and gradients; the step is SGD at learning rate 1,
tests/test_llama.py `_one_step`, so the gradient check covers the staged update too; the 10-step
tests cover adamw's); 10 bf16 steps with remat to 2e-3 (bf16 rounds partial sums in another
order). 4 layers, so 4 stages of 1 layer or 2 of 2.
"""

import json
import shutil

import jax
import numpy as np
import pytest

import disttrain
from disttrain import errors
from disttrain.models import pipeline
from tests import helpers
from tests.helpers import assert_trees_close, devices
from tests.test_context import _config as _lm_config, _losses, _packed
from tests.test_llama import _one_step

ONE = {'mesh.data': 1, 'model.num_layers': 4, 'global_batch_size': 16}
LAYOUTS = {'stage=4': ({'mesh.data': 1, 'mesh.stage': 4}, 4),
           'data 2 x stage 4': ({'mesh.data': 2, 'mesh.stage': 4}, 8),
           'stage=2': ({'mesh.data': 1, 'mesh.stage': 2}, 2),
           'stage 2 x fsdp 2 x tensor 2': ({'mesh.data': 1, 'mesh.stage': 2, 'mesh.fsdp': 2,
                                            'mesh.tensor': 2, 'sharding': 'fsdp',
                                            'fsdp_min_size': 1024}, 8)}


def _config(name: str, layout: str | None = None, m: int = 4, **overrides):
  mesh = LAYOUTS[layout][0] if layout else {}
  return _lm_config(name, **{**ONE, **mesh, 'grad_accum_steps': m, **overrides})


@pytest.mark.slow
def test_one_step_pipelined_equals_one_device():
  """Llama on packed rows over stage 2 x fsdp 2 x tensor 2 (M = 2); GPT (learned positions) on
  causal rows over data 2 x stage 4 (M = 8). (Llama on stage=4 against 1 device: the resumed
  steps of test_a_checkpoint_of_four_stages_resumes_on_one_device.)"""
  rows = _packed(64, 32, 256)
  ref = _one_step(_config('llama', m=1), 1, train_data=rows)
  for layout, m in (('stage 2 x fsdp 2 x tensor 2', 2),):
    loss, grads = _one_step(_config('llama', layout, m), LAYOUTS[layout][1], m, rows)
    np.testing.assert_allclose(loss, ref[0], rtol=1e-5)
    assert_trees_close(grads, ref[1], 1e-5, 1e-6, f'llama {layout} gradient and update (M={m})')
  ref = _one_step(_config('gpt', m=1), 1)
  loss, grads = _one_step(_config('gpt', 'data 2 x stage 4', 8), 8, 8)
  np.testing.assert_allclose(loss, ref[0], rtol=1e-5)
  assert_trees_close(grads, ref[1], 1e-5, 1e-6, 'gpt data 2 x stage 4 gradient and update')


@pytest.mark.slow
@pytest.mark.parametrize('name,layout,n', [('llama', 'data 2 x stage 4', 8)])
def test_ten_bf16_remat_steps_pipelined_equal_one_device(tmp_path, name, layout, n):
  common = {'num_train_steps': 10, 'log_every_steps': 1, 'precision.compute_dtype': 'bfloat16',
            'model.remat': 'full'}
  reference = _losses(_config(name, m=4, **common), tmp_path / 'one', 1)
  piped = _losses(_config(name, layout, **common), tmp_path / 'piped', n)
  np.testing.assert_allclose(piped, reference, rtol=2e-3)
  assert reference[-1] < reference[0]


@pytest.mark.slow
def test_each_stage_holds_its_layers_and_run_json_says_so(tmp_path):
  """stage=4: the stacked layers' parameters and Adam moments per device are a quarter of theirs
  whole (the embeddings stay replicated); run.json reports both and the bubble."""
  cfg = _config('llama', 'stage=4', m=4, num_train_steps=1, log_every_steps=1)
  disttrain.train(cfg, str(tmp_path), devices=devices(4))
  info = json.loads((tmp_path / 'run.json').read_text())['pipeline']
  assert info['stages'] == 4 and info['micro_batches'] == 4
  assert info['bubble_fraction'] == pytest.approx(3 / 7)
  assert info['layer_state_bytes_per_device'] <= 1.1 / 4 * info['layer_state_bytes']
  assert info['other_state_bytes_per_device'] == info['other_state_bytes']
  run = disttrain.setup(cfg, devices=devices(4))
  kernel = run.state.params['blocks']['attention']['query']['kernel']  # [L, D, N, K]
  assert [s.data.shape[0] for s in kernel.addressable_shards] == [1, 1, 1, 1]
  assert sorted({s.index[0].start for s in kernel.addressable_shards}) == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_checkpoint_of_four_stages_resumes_on_one_device_and_on_four_again(tmp_path):
  """Parameters are saved [L, ...] whatever S: 6 steps on stage=4 saved at 3; resumed at 3 on 1
  device, steps 4-6 match the uninterrupted run to float reassociation (1e-5: another S adds
  partial sums in another order), and on stage=4 again bit-exactly. (Stage=2 read the same
  [L, ...] arrays; dropped for the suite's time.)"""
  common = {'num_train_steps': 6, 'log_every_steps': 1, 'checkpoint_every_steps': 3,
            'max_to_keep': 5}
  whole = tmp_path / 'whole'
  straight = _losses(_config('llama', 'stage=4', **common), whole, 4)
  for name, layout, n, rtol in (('one', None, 1, 1e-5), ('four', 'stage=4', 4, 0)):
    workdir = tmp_path / name
    shutil.copytree(whole, workdir)
    shutil.rmtree(workdir / 'checkpoints' / '6')
    (workdir / 'metrics.jsonl').unlink()
    resumed = _losses(_config('llama', layout, **common), workdir, n)
    np.testing.assert_allclose(resumed, straight[3:], rtol=rtol, err_msg=name)


@pytest.mark.parametrize('overrides,n,message', [
    ({'mesh.stage': 3, 'mesh.data': 1, 'grad_accum_steps': 4}, 3,
     'model.num_layers=4 do not split into mesh.stage=3 stages'),
    ({'mesh.stage': 4, 'mesh.data': 1, 'grad_accum_steps': 2}, 4,
     'mesh.stage=4 needs at least as many micro-batches as stages, got grad_accum_steps=2'),
    # A filled stage axis was never checked: M=1 on 4 stages ran with a 75% bubble.
    ({'mesh.stage': -1, 'mesh.data': 1, 'grad_accum_steps': 1}, 4,
     'mesh.stage fills 4 stages on these devices, which need at least as many micro-batches, '
     'got grad_accum_steps=1; set grad_accum_steps >= 4'),
    ({'mesh.stage': 2, 'mesh.data': 1, 'step_mode': 'pmap'}, 2,
     'mesh.stage=2 pipelines layers inside the jit step, not step_mode=pmap'),
    ({'mesh.stage': 2, 'mesh.data': 1, 'model.num_experts': 4}, 2,
     'mixture-of-experts layers, mesh.context > 1 or dropout is not built'),
    # The adapters' dropout too (the stages' layers run without dropout keys: it was off).
    ({'mesh.stage': 2, 'mesh.data': 1, 'lora.rank': 4, 'lora.dropout': 0.5}, 2,
     r'dropout is not built \(got .*dropout=0.5\)'),
])
def test_bad_stage_settings_are_one_line(overrides, n, message):
  with pytest.raises(errors.ConfigError, match=message):
    disttrain.setup(_lm_config('llama', **{**ONE, 'grad_accum_steps': 4, **overrides}),
                    devices=devices(n))


def test_stages_with_a_model_without_layers_is_one_line():
  cfg = helpers.make_config(mesh__data=4, mesh__stage=2, grad_accum_steps=2)
  with pytest.raises(errors.ConfigError, match='has none to split'):
    disttrain.setup(cfg, devices=devices(8))


def test_bubble_fraction():
  assert pipeline.bubble_fraction(4, 4) == 3 / 7
  assert pipeline.bubble_fraction(1, 8) == 0.0
  assert jax.device_count() >= 8

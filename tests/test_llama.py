"""The Llama family (launch/configs/llama.py at a tiny size) on every layout equals 1 device.

Tolerances as in tests/test_equivalence.py: one step agrees to float reassociation of the
cross-device sums (rtol 1e-5). Gradient accumulation (M = 2) on
data x fsdp x tensor equals the global-batch step on 1 device. bf16 on 8 devices follows bf16 on
1 device within 2e-3 over 10 steps: the forward pass rounds partial sums to bf16 in another order
(measured 4e-4).

The one-step checks here and in tests/test_moe.py, test_context.py and test_pipeline.py run
plain SGD at learning rate 1 (see `_one_step`): the new parameters are p - g, so one compiled
train step checks the gradient and the sharded update together. The real optimizers' sharded
updates are covered by tests/test_equivalence.py (Adam's first step on every layout) and by the
10-step tests (adamw with its warm-up and weight decay).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain import data
from disttrain.parallel import sharding
from disttrain.training import setup as run_lib
from tests import helpers
from tests.conftest import ROOT
from tests.helpers import assert_trees_close, devices, to_numpy

LLAMA = ROOT / 'launch' / 'configs' / 'llama.py'
TINY = {'model.num_layers': 2, 'model.hidden': 64, 'model.num_heads': 4,
        'model.num_kv_heads': 2, 'model.mlp_dim': 128, 'data.seq_len': 32,
        'global_batch_size': 16, 'data.text.bytes': 100_000, 'data.eval_examples': 64,
        'eval_batch_size': 64, 'eval_every_steps': 0}
CUBE = {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2}
ONE = {'mesh.data': 1}


def _config(**overrides) -> disttrain.Config:
  cd = helpers.config_file(LLAMA)
  return disttrain.from_config_dict(helpers.override(cd, {**TINY, **overrides}))


def _one_step(cfg, n: int, m: int = 1, train_data=None):
  """(loss, gradients) of one step from the initial state, M micro-batches; on
  `train_data` (in-memory rows) instead of the config's data when given.

  The step is SGD at a constant learning rate of 1 (no warm-up, momentum or weight decay), so the
  new parameters are p1 = p0 - g and the gradients returned are p0 - p1: one compiled program
  (the train step) checks the gradient and its sharded update at once. Recovering g costs the
  rounding of p0 - g, at most |p| x 2^-24 per element, so two runs' gradients differ by up to
  |p| x 2^-23 on top of their own reassociation: under atol 1e-6 while |p| < 8 (these tiny
  models' largest parameters are the norm scales, 1 at initialisation)."""
  kw = {} if train_data is None else {'train_data': train_data, 'eval_data': train_data}
  sgd = helpers.sgd_config(cfg, 1.0, grad_accum_steps=m)
  run = disttrain.setup(sgd, devices=devices(n), **kw)
  it = data.TrainIterator(run.train_data, sgd.global_batch_size, sgd.seed, run.batch_sharding)
  batch = next(it)
  it.close()
  p0 = to_numpy(run.steps.export(run.state).params)  # before the step: it donates the state
  new_state, metrics = run.steps.train(run.steps.place(run.state), batch)
  p1 = to_numpy(run.steps.export(new_state).params)
  return float(metrics['loss']), jax.tree.map(np.subtract, p0, p1)


@pytest.mark.slow
def test_one_step_on_data_fsdp_tensor_with_accumulation_equals_one_device():
  ref_loss, ref_grads = _one_step(_config(**ONE), 1)
  for m in (1, 2):
    loss, grads = _one_step(_config(**CUBE), 8, m)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, 1e-5, 1e-6, f'gradient and update (M={m})')


@pytest.mark.slow
def test_qwen3_one_step_on_data_fsdp_tensor_equals_one_device():
  """Qwen3's change to the decoder (per-head query and key norms, a head size of 24 apart from
  the width's 16) splits over fsdp and tensor like the rest of it. (Qwen2's is biases, which the
  GPT's layers already split.)"""
  fields = {'model.name': 'qwen3', 'model.head_dim': 24}
  ref_loss, ref_grads = _one_step(_config(**ONE, **fields), 1)
  loss, grads = _one_step(_config(**CUBE, **fields), 8)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(grads, ref_grads, 1e-5, 1e-6, 'qwen3 gradient and update')
  paths = {sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]}
  assert 'blocks/attention/query_norm/scale' in paths, paths


@pytest.mark.slow
@pytest.mark.parametrize('fields', [{'model.name': 'qwen2'},
                                    {'model.name': 'mistral', 'model.sliding_window': 8}],
                         ids=['qwen2', 'mistral'])
def test_qwen2_and_mistral_one_step_on_data_fsdp_tensor_equal_one_device(fields):
  """Qwen2's q/k/v biases split over tensor with their heads; Mistral's window (8 of 32)."""
  ref_loss, ref_grads = _one_step(_config(**ONE, **fields), 1)
  loss, grads = _one_step(_config(**CUBE, **fields), 8)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(grads, ref_grads, 1e-5, 1e-6, f'{fields["model.name"]} gradient and update')


# Ten bf16 steps of llama against 1 device: test_context.py (data x context x tensor, M=2) and
# test_pipeline.py (data 2 x stage 4); its one step on data x fsdp x tensor is above (1e-5).


def _specs(**overrides) -> tuple[dict, list[str], dict]:
  cfg = _config(**overrides)
  assert cfg.sharding == 'replicate'  # the field's default: the logical rules split the weights
  run = disttrain.setup(cfg, devices=devices(8))
  return (sharding.spec_lists(run.layout.param_specs), run.layout.replicated,
          run_lib.run_info(run)['param_split'])


def test_kv_heads_split_over_tensor_when_divisible_else_kept_whole():
  specs, whole, split = _specs(**CUBE)
  assert specs['blocks/attention/key/kernel'] == [None, 'fsdp', 'tensor', None]
  assert specs['blocks/attention/query/kernel'] == [None, 'fsdp', 'tensor', None]
  assert specs['blocks/mlp/gate/kernel'] == [None, 'fsdp', 'tensor']
  assert specs['embed'] == ['tensor', 'fsdp'] and not whole
  # What run.json and the console report (sharding=replicate): the axes that really split.
  assert split['axes'] == ['fsdp', 'tensor'] and split['arrays'] == len(specs)
  assert split['split'] == sum(spec != [None] * len(spec) for spec in specs.values())
  specs, whole, split = _specs(**{'mesh.data': 2, 'mesh.tensor': 4})  # 2 K/V heads over tensor=4
  assert specs['blocks/attention/key/kernel'] == [None, 'fsdp', None, None]  # fsdp has size 1
  assert specs['blocks/attention/query/kernel'] == [None, 'fsdp', 'tensor', None]
  assert any('blocks/attention/key/kernel' in w and 'kv_heads=2 is not divisible by tensor=4' in w
             for w in whole), whole
  assert split['axes'] == ['tensor']  # 'fsdp' named in specs, but of size 1: nothing split
  assert split['split'] == sum('tensor' in spec for spec in specs.values())


def test_bf16_forward_runs_in_bf16_with_float32_state():
  cfg = _config(**ONE, **{'precision.compute_dtype': 'bfloat16'})
  run = disttrain.setup(cfg, devices=devices(1))
  batch = {'tokens': jnp.zeros((2, 32), jnp.int32)}
  jaxpr = str(jax.make_jaxpr(lambda p: run.model.apply(
      {'params': jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)}, batch, train=False,
      rng=None))(run.state.params))
  assert 'bf16[2,32,4,16]' in jaxpr  # queries in bf16
  assert {x.dtype for x in jax.tree.leaves(run.state.params)} == {np.dtype('float32')}

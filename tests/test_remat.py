"""Remat policies and scan unrolling change what is kept and how the layers loop, never the math.

The tiny Llama (launch/configs/llama.py, 4 layers) is differentiated directly (its module, a
cross-entropy written here, float32 on one device). Each named remat policy and scan unroll
gives remat=none's loss and gradients to float32 reassociation (XLA fuses a recomputed forward
differently; as in tests/test_big_models.py's remat check). What a policy keeps is counted
exactly: the layers' activations [L, B, T, ...] among jax.vjp's residuals (what the backward pass
reads from the forward pass) are each block's input (remat=full keeps nothing else) plus the
named activations the policy claims, L x B x T x their widths x 4 bytes, the widths worked out
here from the model's shape."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain.models import gpt, llama
from tests import helpers
from tests.conftest import ROOT
from tests.helpers import assert_trees_close

B, T = 2, 32
TOKENS = np.random.default_rng(0).integers(0, 256, (B, T + 1))


def _model_config(family: str, **fields):
  """launch/configs/<family>.py's default (tiny) model with `fields` set."""
  cfg = disttrain.from_config_dict(helpers.config_file(ROOT / 'launch' / 'configs' /
                                                       f'{family}.py'))
  return dataclasses.replace(cfg.model, dropout=0.0, **fields)


def _decoder(family: str, **fields):
  build = {'llama': llama.build, 'gpt': gpt.build}[family]
  return build(_model_config(family, **fields), jnp.float32, T).module


def _loss(module):
  """params -> the mean next-token cross-entropy of TOKENS, float32."""
  def loss(params):
    logits = module.apply({'params': params}, TOKENS[:, :-1])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, TOKENS[:, 1:, None], axis=-1))
  return loss


def _params(module):
  return module.init(jax.random.key(0), TOKENS[:, :-1])['params']


def _loss_and_grads(module, params):
  loss, grads = jax.jit(jax.value_and_grad(_loss(module)))(params)
  return float(loss), jax.device_get(grads)


def _saved_activation_bytes(module, params, num_layers: int) -> int:
  """Bytes of the layers' activations [L, B, T, ...] the backward pass reads from the forward
  pass: jax.vjp's residuals (traced only), less weights (a recomputing block reads its biases)
  and what lies outside the layers."""
  residuals = jax.eval_shape(lambda p: jax.vjp(_loss(module), p)[1], params)
  return sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(residuals)
             if r.shape[:3] == (num_layers, B, T))


def _assert_same_step(actual, expected, what):
  """Loss to 1e-6; each gradient leaf to rtol 1e-6 plus 1e-6 x its largest magnitude."""
  np.testing.assert_allclose(actual[0], expected[0], rtol=1e-6, err_msg=f'loss ({what})')
  flat = dict(jax.tree_util.tree_flatten_with_path(expected[1])[0])
  for path, g in jax.tree_util.tree_flatten_with_path(actual[1])[0]:
    np.testing.assert_allclose(g, flat[path], rtol=1e-6, atol=1e-6 * np.abs(flat[path]).max(),
                               err_msg=f'gradient ({what}) {jax.tree_util.keystr(path)}')


@functools.cache
def _remat_none_step():
  """The tiny Llama's initial parameters and remat=none's (loss, gradients) there."""
  params = _params(_decoder('llama'))
  return params, _loss_and_grads(_decoder('llama'), params)


# The quick tier keeps save_attention_out (its own compile ~2.5 s beside remat=none's); minimal
# (~6 s more) and the unrolled scan (~12 s) run in the full suite.
@pytest.mark.parametrize('remat', [pytest.param('minimal', marks=pytest.mark.slow),
                                   'save_attention_out'])
def test_a_named_remat_policy_computes_remat_none_s_loss_and_gradients(remat):
  params, expected = _remat_none_step()
  _assert_same_step(_loss_and_grads(_decoder('llama', remat=remat), params), expected,
                    f'remat={remat}')


def _saved_widths(family: str) -> dict[str, int]:
  """Features per token that 'minimal' and 'save_attention_out' keep per layer beyond the block
  input, from the model's shape: what each policy says it saves and the backward pass reads."""
  m = _model_config(family)
  head = m.hidden // m.num_heads
  q, kv = m.num_heads * head, (m.num_kv_heads or m.num_heads) * head
  out = m.hidden  # the out-projection's output: the MLP norm's input is x + it
  if family == 'llama':  # q, k, v apart; SwiGLU's gate and up (the down output is never read)
    mlp_in = 2 * m.mlp_dim
  else:  # GPT-2: one fused qkv [3, N, K]; GELU's mlp_in
    mlp_in = m.mlp_dim or 4 * m.hidden
  return {'minimal': q + 2 * kv + out + mlp_in,
          'save_attention_out': q + 2 * kv + q + out}  # + the context [N, K], q's width


@pytest.mark.parametrize('family', ['llama', 'gpt'])
def test_each_named_policy_keeps_exactly_the_activations_it_names(family):
  params = _params(_decoder(family))
  m = _model_config(family)
  saved = {remat: _saved_activation_bytes(_decoder(family, remat=remat), params, m.num_layers)
           for remat in ('none', 'full', 'minimal', 'save_attention_out')}
  per_feature = m.num_layers * B * T * 4  # float32 [L, B, T, features]
  assert saved['full'] == m.hidden * per_feature, saved  # each block's input alone
  for remat, width in _saved_widths(family).items():
    assert saved[remat] == (m.hidden + width) * per_feature, (remat, saved)
    assert saved[remat] < saved['none'], (remat, saved)


@pytest.mark.slow  # ~12 s (the unrolled layers' compile); the quick tier keeps a remat policy
@pytest.mark.parametrize('unroll', [3])  # 3 of 4 layers: a loop and a remainder (2 was cut)
def test_scan_unroll_keeps_the_parameters_and_computes_the_same_step(unroll):
  """Unroll 2 divides the 4 layers, 3 does not (a remainder layer after the loop); both init
  the tree unroll 1 does (a checkpoint loads across them) and compute its loss and gradients."""
  params, expected = _remat_none_step()
  unrolled = _decoder('llama', scan_unroll=unroll)
  assert_trees_close(jax.device_get(_params(unrolled)), jax.device_get(params), 0, 0,
                     f'init (scan_unroll={unroll})')
  jaxpr = str(jax.make_jaxpr(_loss(unrolled))(params))
  assert f'unroll={unroll}' in jaxpr, f'scan_unroll={unroll} never reached the layer scan'
  _assert_same_step(_loss_and_grads(unrolled, params), expected, f'scan_unroll={unroll}')


def test_scan_unroll_must_be_positive():
  with pytest.raises(disttrain.ConfigError, match='model.scan_unroll=0'):
    _model_config('llama', scan_unroll=0)

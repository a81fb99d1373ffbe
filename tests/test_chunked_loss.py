"""The chunked cross-entropy (disttrain/models/chunked_loss.py) equals the full one.

Values and gradients agree to float32 reassociation (the per-row sums run chunk by chunk):
rtol 1e-6, and an absolute floor of 1e-6 of the largest gradient for elements near zero. On
data x tensor x context it equals the full loss on 1 device within the layout tolerances of
tests/test_llama.py. Its point is memory: at V = 262,144 and T = 2,048 the compiled step's
temporaries are at most a quarter of the full loss's (measured 0.12; benchmarks/memory.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disttrain.data.records import ID, MASK
from disttrain.models import chunked_loss
from disttrain.models.decoder import Decoder
from disttrain.models.language_model import LanguageModel
from disttrain.models.task import NextToken
from disttrain.training import setup as run_lib
from tests import test_llama
from tests.helpers import assert_trees_close, to_numpy

V, T, B = 1000, 40, 3


def _model(chunk: int, tied: bool) -> LanguageModel:
  cfg = test_llama._config(**{'model.vocab_size': V, 'model.tied_embeddings': tied,
                              'model.loss_chunk': chunk, 'data.seq_len': T})
  from disttrain.models import llama  # pylint: disable=g-import-not-at-top
  return LanguageModel(Decoder(llama.decoder_config(cfg.model, jnp.float32, T)), family='llama')


def _batch() -> dict:
  rng = np.random.default_rng(0)
  targets = rng.integers(0, V, (B, T)).astype(np.int32)
  targets[0, :7] = -100  # ignored ids, as Hugging Face's
  loss_mask = (rng.random((B, T)) < 0.7).astype(np.int32)
  return {'tokens': rng.integers(0, V, (B, T)).astype(np.int32), 'targets': targets,
          'loss_mask': loss_mask, MASK: np.ones(B, np.float32), ID: np.arange(B, dtype=np.int32)}


@pytest.mark.parametrize('tied', [pytest.param(True, marks=pytest.mark.slow), False])
def test_chunked_loss_equals_full_loss_and_gradients(tied):
  batch = _batch()
  full, chunked = _model(-1, tied), _model(16, tied)  # 16 does not divide 40: a padded chunk
  variables = full.init(jax.random.key(0), batch)

  def values(model, params):
    outputs, _, _ = model.apply({'params': params}, batch, train=False, rng=None)
    return NextToken().per_example(outputs, batch)

  def remade(params, row_weights):  # the path that always remakes the logits (DPO's)
    features = chunked.apply({'params': params}, batch, train=False, rng=None)[0]
    sums = chunked_loss.sums(features, batch['targets'], NextToken().token_weights(batch),
                             fused=False)[0]
    return (sums * row_weights).sum()

  @jax.jit  # one compile for every case: the row weights pick the backward path at run time
  def run(params, row_weights):
    loss = lambda m: lambda p: (values(m, p)['loss'] * row_weights).sum()
    return (values(full, params), values(chunked, params), jax.grad(loss(full))(params),
            jax.grad(loss(chunked))(params), jax.grad(remade)(params, row_weights))

  out = chunked.apply(variables, batch, train=False, rng=None)[0]
  assert isinstance(out, chunked_loss.Features) and out.chunk == 16
  # Rows weighed alike (a batch mean: the gradients made in the forward pass) and unalike (the
  # unembedding's gradient from remade logits).
  for row_weights in (np.ones(B, np.float32), np.array([0.5, 2.0, 0.0], np.float32)):
    want, got, want_g, got_g, remade_g = to_numpy(run(variables['params'], row_weights))
    np.testing.assert_allclose(got['loss'], want['loss'], rtol=1e-6)
    np.testing.assert_array_equal(got['accuracy'], want['accuracy'])
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_g))
    assert_trees_close(got_g, want_g, 1e-6, 1e-6 * scale, f'chunked loss gradients {row_weights}')
    assert_trees_close(remade_g, want_g, 1e-6, 1e-6 * scale,
                       f'remade chunked loss gradients {row_weights}')


def test_a_target_beyond_the_vocabulary_is_nan_full_or_chunked():
  """V = 1000 pads to 1024: a target in [1000, 1024) met the padded logit -1e9 and cost a
  finite 1e9 per token, which no NaN guard saw; >= 1024 was already NaN."""
  batch = _batch()
  for chunk in (-1, 16):
    model = _model(chunk, False)
    variables = model.init(jax.random.key(0), batch)
    for bad in (V, 1023, 1024):
      at = np.arange(T) == 20  # counted in every row
      row = {**batch, 'targets': np.where(at, bad, batch['targets']),
             'loss_mask': np.where(at, 1, batch['loss_mask'])}
      outputs = model.apply(variables, row, train=False, rng=None)[0]
      loss = np.asarray(NextToken().per_example(outputs, row)['loss'])
      assert np.isnan(loss).all() and np.isfinite(np.asarray(
          NextToken().per_example(outputs, batch)['loss'])).all(), (chunk, bad, loss)


def test_auto_chunks_only_large_logits():
  assert chunked_loss.chunk_tokens(0, 128, 256) == 0  # the tiny test models: one matmul
  assert chunked_loss.chunk_tokens(0, 2048, 262_144) == 64  # 64 MiB of logits per row
  assert chunked_loss.chunk_tokens(0, 1024, 32_768) == 0  # 128 MiB a row: at the line, whole
  assert chunked_loss.chunk_tokens(0, 1024, 50_304) == 256  # GPT-2: 4 chunks of 50 MiB
  assert chunked_loss.chunk_tokens(0, 4096, 128_256) == 128  # Llama 3: 32 chunks
  assert chunked_loss.chunk_tokens(-1, 4096, 262_144) == 0
  assert chunked_loss.chunk_tokens(512, 256, 262_144) == 0  # longer than the row: whole
  assert chunked_loss.describe(0, 2048, 262_144)['chunks'] == 32


# Chunked on data x tensor x context against the whole loss on 1 device: tests/test_context.py
# (test_one_step_with_positions_split_equals_one_device, llama on the cube).


@pytest.mark.slow
def test_chunked_step_holds_a_quarter_of_the_temporaries_and_says_so():
  """Gemma's vocabulary at T = 2,048, B = 1 (compiled, not run); run.json's `loss` names it."""
  t = 2048
  window = jax.ShapeDtypeStruct((1, t), np.int32)
  spec = {'tokens': window, 'targets': window, ID: jax.ShapeDtypeStruct((1,), np.int32)}
  temp = {}
  for chunk in (-1, 0):
    cfg = test_llama._config(**test_llama.ONE, **{
        'global_batch_size': 1, 'data.seq_len': t, 'model.vocab_size': 262_144,
        'model.loss_chunk': chunk})
    plan = run_lib.plan(cfg, spec, jax.devices()[:1])
    temp[chunk] = plan.compile().temp_bytes
  assert temp[0] <= 0.25 * temp[-1], temp
  info = chunked_loss.describe(0, t, 262_144)
  assert info['chunked'] and info['chunk_tokens'] == 64, info

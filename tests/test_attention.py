"""The one attention function: equal to the textbook form, packed documents stay apart, and the
blockwise form never holds the whole [B, H, T, T] logits.

Tolerance 1e-5 (float32): the forms differ only in the order of float sums (online softmax
rescaling, blockwise accumulation), measured at <= 1.5e-6 here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disttrain import models
from disttrain.config import MeshConfig, ModelConfig
from disttrain.models import attention as attention_lib
from disttrain.parallel import mesh as mesh_lib, sharding


def _naive(q, k, v, q_seg, kv_seg, offset, window=0):
  """softmax over keys s <= offset + t (and > offset + t - window) of the same segment, K/V heads
  repeated for GQA."""
  t, s, n, g = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
  k, v = jnp.repeat(k, n // g, axis=2), jnp.repeat(v, n // g, axis=2)
  logits = jnp.einsum('bthd,bshd->bhts', q, k) / np.sqrt(q.shape[-1])
  mask = (jnp.arange(s)[None, :] <= offset + jnp.arange(t)[:, None])[None]
  if window:
    mask = mask & (jnp.arange(s)[None, :] > offset + jnp.arange(t)[:, None] - window)[None]
  mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
  probs = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
  return jnp.einsum('bhts,bshd->bthd', probs, v)


CASES = {  # (batch, T, S, query heads, K/V heads, head dim, query offset, block, window)
    'mha': (2, 32, 32, 4, 4, 16, 0, 8, 0),
    'gqa_ragged_blocks': (2, 37, 37, 6, 3, 8, 0, 8, 0),
    'decode_into_cache': (2, 3, 40, 4, 2, 8, 20, 8, 0),
    # Mistral's sliding window: narrower than a block and than the documents, across blocks.
    'window_packed': (2, 37, 37, 6, 3, 8, 0, 8, 5),
    'window_decode': (2, 3, 40, 4, 2, 8, 20, 8, 6),
}


# Each case compiles four gradients: three of them are enough while iterating (-m 'not slow').
FAST = {('decode_into_cache', 'xla'), ('decode_into_cache', 'blockwise'),
        ('gqa_ragged_blocks', 'blockwise'), ('window_packed', 'blockwise'),
        ('window_decode', 'xla')}
# Every head grouping (one K/V head or as many as queries) takes the same grouped reshape
# (attention.py), so mha runs blockwise only and gqa_ragged_blocks covers the rest.
PAIRS = [pytest.param(case, impl, marks=[pytest.mark.slow] * ((case, impl) not in FAST))
         for case in CASES for impl in ('xla', 'blockwise') if (case, impl) != ('mha', 'xla')]


@pytest.mark.parametrize('case,implementation', PAIRS)
def test_attention_equals_the_naive_form_and_its_gradients(case, implementation):
  b, t, s, n, g, d, offset, block, window = CASES[case]
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, d))
  k, v = (jax.random.normal(key, (b, s, g, d)) for key in keys[1:3])
  if t == s:  # packed rows: three documents of random lengths, then padding (segment 0)
    q_seg = kv_seg = jnp.sort(jax.random.randint(keys[3], (b, t), 0, 4), axis=-1)[:, ::-1]
  else:  # a cache: the first 5 slots are padding
    q_seg, kv_seg = jnp.ones((b, t), jnp.int32), (jnp.arange(s) >= 5).astype(jnp.int32)[None]
    kv_seg = jnp.broadcast_to(kv_seg, (b, s))
  ours = lambda q, k, v: attention_lib.attention(
      q, k, v, q_segments_BxT=q_seg, kv_segments_BxS=kv_seg, q_offset=offset,
      implementation=implementation, block_size=block, window=window)
  naive = lambda q, k, v: _naive(q, k, v, q_seg, kv_seg, offset, window)
  np.testing.assert_allclose(jax.jit(ours)(q, k, v), naive(q, k, v), rtol=1e-5, atol=1e-5)
  grad = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), (0, 1, 2)))
  for got, want in zip(grad(ours)(q, k, v), grad(naive)(q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('implementation', [pytest.param('xla', marks=pytest.mark.slow),
                                            'blockwise'])
def test_positions_split_over_context_equal_the_naive_form(implementation):
  """Under a jit step on data 2 x context 2 x tensor 2 (and context 8, with a sliding window of
  12 that reaches across a device's 8 positions), queries split over 'context' against
  all-gathered keys and values: packed rows, GQA; values and gradients."""
  b, t, n, g, d = 4, 64, 4, 2, 8
  keys = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(keys[0], (b, t, n, d))
  k, v = (jax.random.normal(key, (b, t, g, d)) for key in keys[1:3])
  seg = jnp.sort(jax.random.randint(keys[3], (b, t), 0, 4), axis=-1)[:, ::-1]
  for shape, window in (({'data': 2, 'context': 2, 'tensor': 2}, 0), ({'context': 8}, 12)):
    naive = lambda q, k, v: _naive(q, k, v, seg, seg, 0, window)
    want = (naive(q, k, v), jax.grad(lambda *a: jnp.sum(jnp.sin(naive(*a))), (0, 1, 2))(q, k, v))
    mesh = mesh_lib.build(MeshConfig(**{'data': 1, **shape}), jax.devices()[:8])

    def ours(q, k, v):
      with sharding.activation_rules(mesh, (('heads', 'tensor'), ('kv_heads', 'tensor'))):
        q, k, v = (sharding.constrain(x, ('batch', 'sequence', heads, None))
                   for x, heads in ((q, 'heads'), (k, 'kv_heads'), (v, 'kv_heads')))
        return attention_lib.attention(q, k, v, q_segments_BxT=seg, kv_segments_BxS=seg,
                                       implementation=implementation, block_size=8,
                                       window=window)
    compiled = jax.jit(ours).lower(q, k, v).compile().as_text()
    assert 'all-gather' in compiled, 'keys and values are gathered over context'
    np.testing.assert_allclose(jax.jit(ours)(q, k, v), want[0], rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(ours(*a))), (0, 1, 2)))(q, k, v)
    for got, expected in zip(grads, want[1]):
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_blockwise_never_holds_the_whole_score_matrix():
  """T = 4,096, 8 heads: the full float32 logits are 512 MiB per example. XLA's memory analysis
  of the gradient: the dense form's temporaries hold several of them, the blockwise form's
  less than a quarter of one (measured: 1,552 vs 62 MiB)."""
  b, t, h, d = 1, 4096, 8, 64
  full = b * h * t * t * 4
  spec = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)

  def temp_bytes(implementation):
    loss = lambda q, k, v: jnp.sum(attention_lib.attention(q, k, v,
                                                           implementation=implementation))
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(spec, spec, spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes
  assert temp_bytes('blockwise') < full / 4
  assert temp_bytes('xla') > full  # the counterfactual: the dense form does hold them


@pytest.mark.parametrize('name', ['llama', pytest.param('gpt', marks=pytest.mark.slow)])
def test_a_packed_row_of_two_documents_equals_each_document_alone(name):
  """Segment ids keep attention inside each document and positions restart: document 2's
  logits in the packed row equal its logits as a row of its own."""
  cfg = ModelConfig(name=name, hidden=64, num_layers=2, num_heads=4,
                    num_kv_heads=2 if name == 'llama' else 0, vocab_size=101, dropout=0.0)
  model = models.build(cfg, 'float32', 32)
  params = model.init(jax.random.key(0), {'tokens': jnp.zeros((1, 32), jnp.int32)})['params']
  rng = np.random.default_rng(0)
  first, second = rng.integers(0, 101, 13), rng.integers(0, 101, 19)
  packed = jnp.asarray(np.concatenate([first, second])[None])
  segments = jnp.asarray([[1] * 13 + [2] * 19])
  positions = jnp.asarray([list(range(13)) + list(range(19))])
  apply = lambda tokens, **kw: model.module.apply({'params': params}, tokens, False, **kw)
  together = apply(packed, segment_ids=segments, positions=positions)
  np.testing.assert_allclose(together[0, :13], apply(jnp.asarray(first[None]))[0], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(together[0, 13:], apply(jnp.asarray(second[None]))[0], rtol=1e-5,
                             atol=1e-5)
  # The counterfactual: without segment ids the second document sees the first.
  unpacked = apply(packed, positions=positions)
  assert np.abs(unpacked[0, 13:] - together[0, 13:]).max() > 1e-2


def test_a_query_scale_in_bfloat16_is_rounded_per_element_not_once():
  """Gemma's query_pre_attn_scalar scales the queries: in bfloat16, by the factor rounded to
  bfloat16 first, every attention logit was 0.15 % small (Gemma 2 27B's sqrt(128 / 144)); each
  element rounded once leaves no bias (the mean ratio within 1e-4 of 1 over 65,536 values)."""
  from disttrain.models import layers  # pylint: disable=g-import-not-at-top
  factor = float(np.sqrt(128 / 144))
  q = jnp.asarray(np.random.default_rng(0).normal(size=(65_536,)), jnp.bfloat16)
  exact = np.asarray(q, np.float64) * factor
  ratio = np.asarray(layers.scaled(q, factor), np.float64) / exact
  assert abs(ratio.mean() - 1) < 1e-4, ratio.mean()
  np.testing.assert_array_equal(layers.scaled(q.astype(jnp.float32), factor),
                                q.astype(jnp.float32) * np.float32(factor))


def test_cudnn_off_a_gpu_is_one_line_naming_the_field():
  from disttrain.errors import ConfigError  # pylint: disable=g-import-not-at-top
  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  with pytest.raises(ConfigError, match=r"model.attention='cudnn' runs cuDNN's kernel on NVIDIA "
                                        r'GPUs, not cpu; set model.attention=auto'):
    attention_lib.attention(q, q, q, implementation='cudnn')

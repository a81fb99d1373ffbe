"""One attention for every transformer here: causal, per-document segments, GQA, a KV cache.

  attention(q[B, T, N, K], k[B, S, G, K], v[B, S, G, K], ...) -> [B, T, N, K]

Query t sits at absolute position `q_offset + t` of the key sequence (0 in training; the cache
index when decoding) and attends to key s iff s <= q_offset + t, with a sliding `window` W > 0
also s > q_offset + t - W (the last W positions, itself included: Mistral's), and, with segment
ids, the two tokens belong to the same segment (a packed document; 0 marks padding). xla and
blockwise take the window, also under the context split and with a KV cache, and also traced
(Gemma's per-layer local and global windows inside one scan); `auto` does not pick cudnn for a
window. Logit soft-capping (`softcap`, Gemma 2's c tanh(x / c)) runs on xla alone (its own
dense form, transformers' eager order); `auto` picks xla for it, blockwise and cudnn refuse it. N query heads share
G = N / R key/value heads (grouped-query attention; G = N is multi-head). Logits and the softmax
are float32 whatever the inputs' dtype. Implementations:
  xla        jax.nn.dot_product_attention's XLA form: holds [B, N, T, S] float32 logits.
  cudnn      jax.nn.dot_product_attention(implementation='cudnn'): cuDNN's fused kernel (GPUs,
             bf16/fp16, head dim <= 128 and a multiple of 8).
  blockwise  flash attention in plain JAX (online softmax over key blocks, a custom VJP that
             recomputes the probabilities): never more than [B, N, block, block] logits at once.
  auto       cudnn where it applies, else blockwise once T x S > 1024^2, else xla.

Context parallelism: inside a jit step on a mesh whose 'context' axis splits positions
(sharding.sequence_split), each device keeps its T / C queries and all-gathers keys, values and
their segment ids over that axis (MaxText's default on GPUs; the backward reduce-scatters their
gradients), then runs one of the implementations above with q_offset = its first position. Keys
and values are G K wide (G <= N heads), so the gather moves less than the activations; every
device scans every key block (masked ones too), so the causal work is balanced without
reordering positions. A ring (ppermute) would hold one K/V block at a time instead of all S.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from disttrain.errors import ConfigError
from disttrain.parallel import sharding

IMPLEMENTATIONS = ('auto', 'xla', 'cudnn', 'blockwise')
_DENSE_MAX_KEYS = 1024  # auto: beyond 1024 x 1024 logits per head, blockwise
_NEG = -1e30  # masked logits (finite: a fully masked block must not make NaNs)


def attention(q_BxTxNxK: jax.Array, k_BxSxGxK: jax.Array, v_BxSxGxK: jax.Array, *,
              q_segments_BxT: jax.Array | None = None, kv_segments_BxS: jax.Array | None = None,
              q_offset: jax.Array | int = 0, implementation: str = 'auto',
              block_size: int = 512, window: int | jax.Array = 0,
              softcap: float = 0.0) -> jax.Array:
  """softmax(q k^T / sqrt(K) masked causally, by window and by segment) v; see the module
  docstring. `window` may be traced (a per-layer value inside a scan); `softcap` > 0 caps the
  logits at c tanh(logits / c) (Gemma 2), on the xla path only."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'attention implementation {implementation!r} is not one of '
                     f'{IMPLEMENTATIONS}')
  if implementation == 'cudnn' and jax.devices()[0].platform != 'gpu':  # JAX: a bare RuntimeError
    raise ConfigError(f"model.attention='cudnn' runs cuDNN's kernel on NVIDIA GPUs, not "
                      f"{jax.devices()[0].platform}; set model.attention=auto (it picks cuDNN "
                      'where it applies) or xla')
  if softcap and implementation in ('cudnn', 'blockwise'):
    raise ValueError(f'attention softcapping runs on the xla implementation only, not '
                     f'{implementation!r}; set model.attention=xla (or auto)')
  t, s = q_BxTxNxK.shape[1], k_BxSxGxK.shape[1]
  if (q_segments_BxT is None) != (kv_segments_BxS is None):
    raise ValueError('give both q_segments and kv_segments, or neither')
  split = sharding.sequence_split()
  if split is not None and isinstance(q_offset, int) and q_offset == 0 and t == s:
    return _positions_split(q_BxTxNxK, k_BxSxGxK, v_BxSxGxK, q_segments_BxT, *split,
                            implementation, block_size, window, softcap)
  return _local(q_BxTxNxK, k_BxSxGxK, v_BxSxGxK, q_segments_BxT, kv_segments_BxS, q_offset,
                implementation, block_size, window, softcap)


def _positions_split(q, k, v, segments, mesh, axis: str, implementation: str,
                     block_size: int, window, softcap: float) -> jax.Array:
  """Self-attention with positions split over `axis`: each device's queries against the keys
  and values all-gathered from every device (see the module docstring)."""
  # XLA:CPU aborts compiling a bf16 all-gather's gradient (ChangeOpDataType, jax 0.12): gather
  # float32 there; accelerators gather the compute dtype.
  wide = jnp.float32 if mesh.devices.flat[0].platform == 'cpu' else None

  def local(q, k, v, segments, window):
    def gather(x):
      if wide is not None and jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.all_gather(x.astype(wide), axis, axis=1, tiled=True).astype(x.dtype)
      return jax.lax.all_gather(x, axis, axis=1, tiled=True)
    offset = jax.lax.axis_index(axis) * q.shape[1]
    kv_segments = None if segments is None else gather(segments)
    return _local(q, gather(k), gather(v), segments, kv_segments, offset, implementation,
                  block_size, window, softcap)
  split = P(None, axis)  # manual over `axis` only: GSPMD keeps the batch and heads split
  if isinstance(window, int):  # static: stays a Python int inside
    return jax.shard_map(lambda q, k, v, s: local(q, k, v, s, window), mesh=mesh,
                         in_specs=(split,) * 4, out_specs=split, axis_names={axis},
                         check_vma=False)(q, k, v, segments)
  return jax.shard_map(local, mesh=mesh, in_specs=(split,) * 4 + (P(),), out_specs=split,
                       axis_names={axis}, check_vma=False)(q, k, v, segments, window)


def _windowed(window) -> bool:
  return not isinstance(window, int) or window > 0


def _local(q_BxTxNxK, k_BxSxGxK, v_BxSxGxK, q_segments_BxT, kv_segments_BxS, q_offset,
           implementation: str, block_size: int, window=0, softcap: float = 0.0) -> jax.Array:
  """attention() on arrays this device holds whole along T and S."""
  t, s = q_BxTxNxK.shape[1], k_BxSxGxK.shape[1]
  if implementation == 'auto':
    implementation = 'blockwise' if t * s > _DENSE_MAX_KEYS**2 and not softcap else 'xla'
    if _cudnn_applies(q_BxTxNxK, q_offset, t, s) and not _windowed(window) and not softcap:
      implementation = 'cudnn'
  if implementation == 'blockwise':
    return _blockwise(q_BxTxNxK, k_BxSxGxK, v_BxSxGxK, q_segments_BxT, kv_segments_BxS,
                      jnp.asarray(q_offset, jnp.int32), min(block_size, max(t, s)),
                      jnp.asarray(window, jnp.int32))
  static_causal = isinstance(q_offset, int) and q_offset == 0 and t == s
  mask = None
  if q_segments_BxT is not None or not static_causal or _windowed(window) or softcap:
    mask = _mask(t, s, q_segments_BxT, kv_segments_BxS, q_offset, window)[:, None]  # [B,1,T,S]
  if softcap:
    return _capped(q_BxTxNxK, k_BxSxGxK, v_BxSxGxK, mask, softcap)
  return jax.nn.dot_product_attention(
      q_BxTxNxK, k_BxSxGxK, v_BxSxGxK, mask=mask, is_causal=static_causal and mask is None,
      implementation=implementation)


def _cudnn_applies(q: jax.Array, q_offset, t: int, s: int) -> bool:
  head_dim = q.shape[-1]
  return (jax.devices()[0].platform == 'gpu' and q.dtype in (jnp.bfloat16, jnp.float16)
          and head_dim <= 128 and head_dim % 8 == 0 and t == s
          and isinstance(q_offset, int) and q_offset == 0)


def _capped(q_BxTxNxK, k_BxSxGxK, v_BxSxGxK, mask_Bx1xTxS, cap: float) -> jax.Array:
  """The xla form with soft-capped logits, as transformers' eager Gemma 2: scaled, capped,
  masked, softmax in float32."""
  b, t, n, d = q_BxTxNxK.shape
  g = k_BxSxGxK.shape[2]
  q = q_BxTxNxK.reshape(b, t, g, n // g, d)
  logits = jnp.einsum('btgrk,bsgk->bgrts', q, k_BxSxGxK,
                      preferred_element_type=jnp.float32) / np.sqrt(d)
  logits = cap * jnp.tanh(logits / cap)
  logits = jnp.where(mask_Bx1xTxS[:, :, None], logits, _NEG)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum('bgrts,bsgk->btgrk', probs.astype(v_BxSxGxK.dtype), v_BxSxGxK)
  return out.reshape(b, t, n, d)


def _visible(q_pos, k_pos, window) -> jax.Array:
  """[T, S] booleans: key k_pos at or before query q_pos, and within the window if any (a traced
  window <= 0 is none)."""
  mask = k_pos[None, :] <= q_pos[:, None]
  if isinstance(window, int):
    return mask & (k_pos[None, :] > q_pos[:, None] - window) if window else mask
  return mask & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))


def _mask(t: int, s: int, q_seg, kv_seg, q_offset, window=0) -> jax.Array:
  """[B or 1, T, S] booleans: causal (query t at q_offset + t), windowed, same segment."""
  q_pos = jnp.asarray(q_offset, jnp.int32) + jnp.arange(t, dtype=jnp.int32)
  mask = _visible(q_pos, jnp.arange(s, dtype=jnp.int32), window)[None]
  if q_seg is not None:
    mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
  return mask


def _pad_to(x: jax.Array | None, length: int, axis: int = 1, value=0):
  if x is None or x.shape[axis] == length:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _blockwise(q, k, v, q_seg, kv_seg, q_offset, block: int, window):
  """Pads T and S to multiples of `block` (padded keys never attended), runs the flash kernel."""
  b, t, n, d = q.shape
  s, g = k.shape[1], k.shape[2]
  tp, sp = -(-t // block) * block, -(-s // block) * block
  if q_seg is None:  # one segment per row; padded keys get segment -1 below
    q_seg, kv_seg = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)
  q_seg = _pad_to(q_seg.astype(jnp.int32), tp, value=-2)
  kv_seg = _pad_to(kv_seg.astype(jnp.int32), sp, value=-1)
  qg = _pad_to(q, tp).reshape(b, tp, g, n // g, d)
  out = _flash(qg, _pad_to(k, sp), _pad_to(v, sp), q_seg, kv_seg, q_offset, window, block)
  return out.reshape(b, tp, n, d)[:, :t]


def _block_logits(q_i, k_j, seg_i, seg_j, pos_i, pos_j, scale, window):
  """Masked float32 logits [B, G, R, bq, bk] of one (query block, key block) pair."""
  logits = jnp.einsum('btgrk,bsgk->bgrts', q_i, k_j, preferred_element_type=jnp.float32) * scale
  mask = _visible(pos_i, pos_j, window)[None] & (seg_i[:, :, None] == seg_j[:, None, :])
  return jnp.where(mask[:, None, None], logits, _NEG), mask[:, None, None]


def _blocks(x: jax.Array, block: int) -> jax.Array:
  """[B, L, ...] -> [L / block, B, block, ...] (scan over the leading axis)."""
  return jnp.moveaxis(x.reshape((x.shape[0], x.shape[1] // block, block) + x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
  """Inverse of _blocks."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _forward(q, k, v, q_seg, kv_seg, q_offset, block, window):
  """(out [B, T, G, R, K] in q's dtype, logsumexp [B, G, R, T] float32)."""
  scale = 1.0 / np.sqrt(q.shape[-1])
  kb, vb, segb = _blocks(k, block), _blocks(v, block), _blocks(kv_seg, block)
  key_pos = jnp.arange(k.shape[1], dtype=jnp.int32).reshape(-1, block)

  def query_block(args):
    q_i, seg_i, i = args
    pos_i = q_offset + i * block + jnp.arange(block, dtype=jnp.int32)
    b, _, g, r, d = q_i.shape
    init = (jnp.full((b, g, r, block), _NEG, jnp.float32), jnp.zeros((b, g, r, block), jnp.float32),
            jnp.zeros((b, g, r, block, d), jnp.float32))

    def key_block(carry, xs):
      m, l, o = carry
      k_j, v_j, seg_j, pos_j = xs
      logits, mask = _block_logits(q_i, k_j, seg_i, seg_j, pos_i, pos_j, scale, window)
      m_new = jnp.maximum(m, logits.max(-1))
      p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)
      correction = jnp.exp(m - m_new)
      o = o * correction[..., None] + jnp.einsum('bgrts,bsgk->bgrtk', p.astype(v_j.dtype), v_j,
                                                 preferred_element_type=jnp.float32)
      return (m_new, l * correction + p.sum(-1), o), None
    (m, l, o), _ = jax.lax.scan(key_block, init, (kb, vb, segb, key_pos))
    safe_l = jnp.where(l > 0, l, 1.0)
    out = jnp.moveaxis(o / safe_l[..., None], 3, 1)  # [B, bq, G, R, K]
    return out.astype(q.dtype), m + jnp.log(safe_l)
  n_q = q.shape[1] // block
  out, lse = jax.lax.map(query_block, (_blocks(q, block), _blocks(q_seg, block),
                                       jnp.arange(n_q, dtype=jnp.int32)))
  return _unblocks(out), jnp.moveaxis(lse, 0, 3).reshape(lse.shape[1:4] + (-1,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, q_seg, kv_seg, q_offset, window, block):
  return _forward(q, k, v, q_seg, kv_seg, q_offset, block, window)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, q_offset, window, block):
  out, lse = _forward(q, k, v, q_seg, kv_seg, q_offset, block, window)
  return out, (q, k, v, q_seg, kv_seg, q_offset, window, out, lse)


def _flash_bwd(block, residuals, d_out):
  """FlashAttention-2's backward: per key block, probabilities recomputed from the logsumexp."""
  q, k, v, q_seg, kv_seg, q_offset, window, out, lse = residuals
  scale = 1.0 / np.sqrt(q.shape[-1])
  # delta_t = sum_k dO * O: the softmax Jacobian's row term.
  delta = jnp.einsum('btgrk,btgrk->bgrt', d_out.astype(jnp.float32), out.astype(jnp.float32))
  kb, vb, segb = _blocks(k, block), _blocks(v, block), _blocks(kv_seg, block)
  key_pos = jnp.arange(k.shape[1], dtype=jnp.int32).reshape(-1, block)
  n_q = q.shape[1] // block
  lse_b = jnp.moveaxis(lse.reshape(lse.shape[:3] + (n_q, block)), 3, 0)
  delta_b = jnp.moveaxis(delta.reshape(delta.shape[:3] + (n_q, block)), 3, 0)

  def query_block(carry, xs):
    dk, dv = carry  # float32 [n_k, B, bk, G, K]
    q_i, do_i, seg_i, lse_i, delta_i, i = xs
    pos_i = q_offset + i * block + jnp.arange(block, dtype=jnp.int32)
    do_i = do_i.astype(jnp.float32)

    def key_block(dq_i, xs):
      k_j, v_j, seg_j, pos_j = xs
      logits, mask = _block_logits(q_i, k_j, seg_i, seg_j, pos_i, pos_j, scale, window)
      p = jnp.where(mask, jnp.exp(logits - lse_i[..., None]), 0.0)
      dv_j = jnp.einsum('bgrts,btgrk->bsgk', p, do_i)
      dp = jnp.einsum('btgrk,bsgk->bgrts', do_i, v_j, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None]) * scale
      dq_i = dq_i + jnp.einsum('bgrts,bsgk->btgrk', ds, k_j, preferred_element_type=jnp.float32)
      dk_j = jnp.einsum('bgrts,btgrk->bsgk', ds, q_i, preferred_element_type=jnp.float32)
      return dq_i, (dk_j, dv_j)
    dq_i, (dk_i, dv_i) = jax.lax.scan(key_block, jnp.zeros(q_i.shape, jnp.float32),
                                      (kb, vb, segb, key_pos))
    return (dk + dk_i, dv + dv_i), dq_i
  zeros = jnp.zeros(kb.shape, jnp.float32)
  (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros),
                              (_blocks(q, block), _blocks(d_out, block), _blocks(q_seg, block),
                               lse_b, delta_b, jnp.arange(n_q, dtype=jnp.int32)))
  return (_unblocks(dq).astype(q.dtype), _unblocks(dk).astype(k.dtype),
          _unblocks(dv).astype(v.dtype), None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)

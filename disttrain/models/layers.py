"""The parts decoder-only transformers here are built from: norms, rotary embeddings, attention
projections with a KV cache, feed-forward layers.

Every weight names its logical axes (embed -> fsdp; heads, kv_heads, mlp, vocab -> tensor in the
example configs): W_q[D_fsdp, N_tensor, K], W_k, W_v[D_fsdp, G_tensor, K], W_o[N_tensor, K, D_fsdp],
W_in[D_fsdp, F_tensor], W_out[F_tensor, D_fsdp]. Activations name theirs too ('batch' first), so
under disttrain's jit step XLA keeps them split by example while it gathers fsdp-split weights.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from disttrain.models import lora as lora_lib
from disttrain.models.attention import attention
from disttrain.parallel import sharding

INIT = nn.initializers.normal(stddev=0.02)
# The block's named activations (MaxText's names), from which decoder.py's remat policies pick
# what the backward pass keeps: the projections' outputs and attention's output before `out`.
QKV_PROJ = ('query_proj', 'key_proj', 'value_proj', 'qkv_proj')  # qkv_proj: fused (GPT-2)
CONTEXT = 'context'  # attention's output [B, T, N, K], the out-projection's input
OUT_PROJ = 'out_proj'
MLP_IN = 'mlpwi'  # gate and up (SwiGLU, GeGLU), or mlp_in (GELU)
MLP_OUT = 'mlpwo'


def weights(axes: tuple, init=INIT):
  """An initializer carrying logical axis names (nn.with_logical_partitioning)."""
  return nn.with_logical_partitioning(init, axes)


def constrain(x: jax.Array, axes: tuple) -> jax.Array:
  """A logical sharding constraint (a no-op outside a jit-style step, e.g. in shard_map)."""
  return sharding.constrain(x, axes)


class OffsetRMSNorm(nn.Module):
  """Gemma's RMSNorm: x / rms(x) x (1 + scale), scale initialised to 0, all in float32."""
  eps: float
  dtype: Any
  axis: str = 'embed'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param('scale', weights((self.axis,), nn.initializers.zeros_init()),
                       (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)


def norm(kind: str, eps: float, dtype, name: str) -> nn.Module:
  """RMSNorm (scale), Gemma's (1 + scale) RMSNorm ('offset_rmsnorm') or LayerNorm (scale and
  bias) over the width, reduced in float32."""
  ones = weights(('embed',), nn.initializers.ones_init())
  if kind == 'offset_rmsnorm':
    return OffsetRMSNorm(eps, dtype, name=name)
  if kind == 'rmsnorm':
    return nn.RMSNorm(epsilon=eps, dtype=dtype, scale_init=ones, name=name)
  return nn.LayerNorm(epsilon=eps, dtype=dtype, scale_init=ones,
                      bias_init=weights(('embed',), nn.initializers.zeros_init()), name=name)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3's long-context frequency scaling ('llama3'); kind '' = plain RoPE."""
  kind: str = ''
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()):
  """Inverse frequencies [K / 2] as Hugging Face computes them (float32)."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  if scaling.kind == 'linear':  # Gemma 3's global layers beyond 1B: positions / factor
    inv_freq = inv_freq / scaling.factor
  if scaling.kind == 'llama3':
    wavelen = 2 * np.pi / inv_freq
    low = scaling.original_max_len / scaling.low_freq_factor  # longer wavelengths: scaled
    high = scaling.original_max_len / scaling.high_freq_factor  # shorter: kept
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    mid = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    inv_freq = np.where(wavelen > low, inv_freq / scaling.factor,
                        np.where(wavelen < high, inv_freq, mid))
  return inv_freq.astype(np.float32)


def scaled(x: jax.Array, factor: float) -> jax.Array:
  """x * factor in float32, rounded once to x's dtype: a factor rounded to bfloat16 first would
  scale every element by the same wrong number (Gemma 2 27B's 0.9428 became 0.9414)."""
  return (x.astype(jnp.float32) * np.float32(factor)).astype(x.dtype)


def apply_rope(x_BxTxHxK: jax.Array, positions_BxT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotary embedding in the rotate-half layout (Hugging Face's), computed in float32."""
  angles_BxTxK2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  cos = jnp.cos(jnp.concatenate([angles_BxTxK2] * 2, -1))[:, :, None]
  sin = jnp.sin(jnp.concatenate([angles_BxTxK2] * 2, -1))[:, :, None]
  x = x_BxTxHxK.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
  return (x * cos + rotated * sin).astype(x_BxTxHxK.dtype)


@dataclasses.dataclass(frozen=True)
class Decode:
  """What every layer shares while decoding: the cache's segment ids [B, S] (0 = empty or
  padding) and the index where this call's tokens are written."""
  segments_BxS: jax.Array
  index: jax.Array


class Attention(nn.Module):
  """Self-attention with grouped K/V heads, optional RoPE and an optional KV cache.

  `fused_qkv` keeps one [D, 3, N, K] projection (GPT-2's layout); otherwise query, key and value
  are separate (Llama's, where K/V have G <= N heads). With a cache ({'k', 'v': [B, S, G, K]}),
  this call's keys and values are written at decode.index and the queries attend to the cache.
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  use_bias: bool
  fused_qkv: bool
  dtype: Any
  rope: Any = None  # inverse frequencies (tuple) or None for no rotary embedding
  implementation: str = 'auto'
  block_size: int = 512
  qkv_bias: bool | None = None  # biases on query, key and value; None = use_bias (Qwen2: True)
  qk_norm_eps: float = 0.0  # > 0: RMSNorm over each head's queries and keys, before RoPE (Qwen3)
  window: int = 0  # sliding-window attention over the last `window` positions; 0 = all
  qk_norm_offset: bool = False  # the head norms are Gemma's (1 + scale) RMSNorm
  query_scale: float = 0.0  # logits' scale; 0 = 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar)
  softcap: float = 0.0  # attention logits capped at c tanh(x / c); 0 = none (Gemma 2: 50)
  local_rope: Any = None  # inverse frequencies of the layers with a window (Gemma's local base)
  lora: Any = None  # lora.LoraSpec: adapters on the projections it targets
  dot_general: Any = None  # the projections' matmul (float8.dot_general); None = lax's

  def _dense(self, features: tuple, axes: tuple, name: str):
    bias = self.use_bias if self.qkv_bias is None else self.qkv_bias
    dense = nn.DenseGeneral(features, use_bias=bias, dtype=self.dtype, name=name,
                            dot_general=self.dot_general, kernel_init=weights(('embed',) + axes),
                            bias_init=weights(axes, nn.initializers.zeros_init()))
    return lora_lib.adapted(dense, self.lora, f'blocks/{self.name}/{name}/kernel', features,
                            ('embed',), axes, self.dtype)

  def _head_norm(self, x_BxTxHxK: jax.Array, name: str) -> jax.Array:
    if not self.qk_norm_eps:
      return x_BxTxHxK
    if self.qk_norm_offset:
      return OffsetRMSNorm(self.qk_norm_eps, self.dtype, 'head_dim', name=name)(x_BxTxHxK)
    return nn.RMSNorm(epsilon=self.qk_norm_eps, dtype=self.dtype, name=name,
                      scale_init=weights(('head_dim',), nn.initializers.ones_init()))(x_BxTxHxK)

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, segments_BxT, decode: Decode | None, cache,
               layer_window=None):
    """`layer_window`: this layer's window when layers differ (traced, from the scan)."""
    n, g, k = self.num_heads, self.num_kv_heads, self.head_dim
    if self.fused_qkv:
      qkv = self._dense((3, n, k), (None, 'heads', 'head_dim'), 'qkv')(x_BxTxD)
      qkv = checkpoint_name(constrain(qkv, ('batch', 'sequence', None, 'heads', None)),
                            'qkv_proj')
      q, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
      q = checkpoint_name(constrain(self._dense((n, k), ('heads', 'head_dim'), 'query')(x_BxTxD),
                                    ('batch', 'sequence', 'heads', None)), 'query_proj')
      key, value = (checkpoint_name(
          constrain(self._dense((g, k), ('kv_heads', 'head_dim'), name)(x_BxTxD),
                    ('batch', 'sequence', 'kv_heads', None)), f'{name}_proj')
          for name in ('key', 'value'))
    q, key = self._head_norm(q, 'query_norm'), self._head_norm(key, 'key_norm')
    if self.rope is not None:
      inv_freq = np.asarray(self.rope, np.float32)
      if self.local_rope is not None and layer_window is not None:
        inv_freq = jnp.where(layer_window > 0, np.asarray(self.local_rope, np.float32), inv_freq)
      q, key = apply_rope(q, positions_BxT, inv_freq), apply_rope(key, positions_BxT, inv_freq)
    if self.query_scale:  # attention() divides by sqrt(K)
      q = scaled(q, self.query_scale * np.sqrt(k))
    options = dict(implementation=self.implementation, block_size=self.block_size,
                   window=self.window if layer_window is None else layer_window,
                   softcap=self.softcap)
    if cache is None:
      out = attention(q, key, value, q_segments_BxT=segments_BxT, kv_segments_BxS=segments_BxT,
                      **options)
      new_cache = None
    else:
      at = (0, decode.index, 0, 0)
      new_cache = {'k': jax.lax.dynamic_update_slice(cache['k'], key.astype(cache['k'].dtype), at),
                   'v': jax.lax.dynamic_update_slice(cache['v'], value.astype(cache['v'].dtype),
                                                     at)}
      out = attention(q, new_cache['k'].astype(q.dtype), new_cache['v'].astype(q.dtype),
                      q_segments_BxT=segments_BxT, kv_segments_BxS=decode.segments_BxS,
                      q_offset=decode.index, **options)
    out = checkpoint_name(out, CONTEXT)
    out_proj = nn.DenseGeneral(x_BxTxD.shape[-1], axis=(-2, -1), use_bias=self.use_bias,
                               dtype=self.dtype, name='out', dot_general=self.dot_general,
                               kernel_init=weights(('heads', 'head_dim', 'embed')),
                               bias_init=weights(('embed',), nn.initializers.zeros_init()))
    out_BxTxD = lora_lib.adapted(out_proj, self.lora, f'blocks/{self.name}/out/kernel',
                                 (x_BxTxD.shape[-1],), ('heads', 'head_dim'), ('embed',),
                                 self.dtype)(out)
    return checkpoint_name(out_BxTxD, OUT_PROJ), new_cache


class Mlp(nn.Module):
  """GELU (tanh form, GPT-2's gelu_new: mlp_in, mlp_out), SwiGLU (Llama's: gate, up, down) or
  GeGLU (Gemma's: SwiGLU's weights with tanh-form GELU on the gate)."""
  kind: str  # 'gelu', 'swiglu' or 'geglu'
  hidden: int
  use_bias: bool
  dtype: Any
  lora: Any = None  # lora.LoraSpec: adapters on the projections it targets
  dot_general: Any = None  # the projections' matmul (float8.dot_general); None = lax's

  def _dense(self, features: int, axes: tuple, name: str):
    dense = nn.Dense(features, use_bias=self.use_bias, dtype=self.dtype, name=name,
                     dot_general=self.dot_general, kernel_init=weights(axes),
                     bias_init=weights(axes[1:], nn.initializers.zeros_init()))
    return lora_lib.adapted(dense, self.lora, f'blocks/{self.name}/{name}/kernel', (features,),
                            axes[:1], axes[1:], self.dtype)

  @nn.compact
  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    d = x_BxTxD.shape[-1]
    if self.kind in ('swiglu', 'geglu'):
      act = nn.silu if self.kind == 'swiglu' else nn.gelu  # flax's gelu: the tanh form
      gate_BxTxF, up_BxTxF = (checkpoint_name(self._dense(self.hidden, ('embed', 'mlp'), name)(
          x_BxTxD), MLP_IN) for name in ('gate', 'up'))
      h_BxTxF = constrain(act(gate_BxTxF) * up_BxTxF, ('batch', 'sequence', 'mlp'))
      return checkpoint_name(self._dense(d, ('mlp', 'embed'), 'down')(h_BxTxF), MLP_OUT)
    h_BxTxF = checkpoint_name(self._dense(self.hidden, ('embed', 'mlp'), 'mlp_in')(x_BxTxD),
                              MLP_IN)
    h_BxTxF = constrain(nn.gelu(h_BxTxF), ('batch', 'sequence', 'mlp'))
    return checkpoint_name(self._dense(d, ('mlp', 'embed'), 'mlp_out')(h_BxTxF), MLP_OUT)

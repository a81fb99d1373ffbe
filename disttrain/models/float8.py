"""Float8 matmuls with current scaling: the decoder's dense projections under
precision.matmul='float8'.

Every call scales each operand by its own amax, computed on the spot (per-tensor current scaling,
Transformer Engine's Float8CurrentScaling recipe), so no scale or amax history is state:

  forward   y  = [x / s_x]_e4m3 . [w / s_w]_e4m3     x s_x s_w      s_t = amax|t| / 448
  backward  dx = [g / s_g]_e5m2 . [w / s_w]_e4m3^T   x s_g s_w      s_g = amax|g| / 57344
            dw = [x / s_x]_e4m3^T . [g / s_g]_e5m2   x s_x s_g

[.] clips to the format's largest finite value and rounds to the nearest float8. Products
accumulate in float32 and the result is cast to the operands' dtype (the compute dtype); the
backward pass reuses the forward's float8 operands, which are all it keeps. amax is a jnp.max
over the whole tensor: under a jit step over a sharded tensor XLA reduces it across devices, so
the scale is the tensor's, the same on every layout (under shard_map it would be each device's,
which is why the config asks for step_mode=jit). On Hopper and later XLA rewrites
dot(f8, f8) x scale into a float8 cuBLASLt GEMM; XLA:CPU converts the float8 values to float32
first (exactly), so CPU runs check the numbers, not the speed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, largest finite 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, largest finite 57344, a wider range


def scale(t: jax.Array, dtype) -> jax.Array:
  """amax|t| / (dtype's largest finite value), float32; 1 for an all-zero tensor."""
  amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
  return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def quantize(t: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """(t / s clipped to dtype's range and rounded to dtype, s): t's float8 form and its scale."""
  s = scale(t, dtype)
  limit = float(jnp.finfo(dtype).max)  # float8_e4m3fn has no infinity: past it lies NaN
  return jnp.clip(t.astype(jnp.float32) / s, -limit, limit).astype(dtype), s


def _dot(a: jax.Array, b: jax.Array, a_axes, b_axes) -> jax.Array:
  """a and b contracted over a_axes against b_axes, accumulated in float32."""
  return jax.lax.dot_general(a, b, ((tuple(a_axes), tuple(b_axes)), ((), ())),
                             preferred_element_type=jnp.float32)


def _free(ndim: int, contracting) -> list[int]:
  return [a for a in range(ndim) if a not in contracting]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, contracting: tuple) -> jax.Array:
  return _forward(x, w, contracting)[0]


def _forward(x, w, contracting):
  qx, sx = quantize(x, E4M3)
  qw, sw = quantize(w, E4M3)
  y = (_dot(qx, qw, *contracting) * (sx * sw)).astype(x.dtype)
  return y, (qx, sx, qw, sw)


def _backward(contracting, residuals, g):
  qx, sx, qw, sw = residuals
  cx, cw = contracting
  fx, fw = _free(qx.ndim, cx), _free(qw.ndim, cw)
  qg, sg = quantize(g, E5M2)
  # dot_general puts the free axes first, in order; the transposes put x's and w's axes back.
  dx = _dot(qg, qw, range(len(fx), g.ndim), fw) * (sg * sw)
  dx = jnp.transpose(dx, np.argsort(fx + [cx[cw.index(a)] for a in sorted(cw)]))
  dw = _dot(qx, qg, fx, range(len(fx))) * (sx * sg)
  dw = jnp.transpose(dw, np.argsort([cw[cx.index(a)] for a in sorted(cx)] + fw))
  return dx.astype(g.dtype), dw.astype(g.dtype)


_matmul.defvjp(_forward, _backward)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                preferred_element_type=None) -> jax.Array:
  """lax.dot_general in float8 with current scaling (the module docstring): what nn.Dense and
  nn.DenseGeneral take as `dot_general`. `precision` is ignored (float8 is the precision).

  Raises:
    ValueError: for batch dimensions, which the dense projections never have.
  """
  del precision
  (lhs_contracting, rhs_contracting), batch = dimension_numbers
  if any(batch):
    raise ValueError(f'float8.dot_general contracts dense projections, which have no batch '
                     f'dimensions; got {batch}')
  dtype = jnp.result_type(lhs, rhs)
  out = _matmul(lhs.astype(dtype), rhs.astype(dtype),
                (tuple(lhs_contracting), tuple(rhs_contracting)))
  return out if preferred_element_type is None else out.astype(preferred_element_type)

"""The checks every example's fields pass, each failure one line naming the field and the fix: a
field is one numeric array (not ragged, not strings), its values fit the 32-bit dtype JAX computes
in, and an in-memory source's fields share one leading dimension."""

from typing import Any

import jax
import ml_dtypes
import numpy as np

from disttrain.errors import DataError, first_line


def is_array(value: Any) -> bool:
  return isinstance(value, (np.ndarray, jax.Array))


def is_in_memory(source: Any) -> bool:
  """A dict of arrays (one in-memory source), as opposed to a dict of named sources."""
  return isinstance(source, dict) and bool(source) and all(is_array(v) for v in source.values())


def shown(indices) -> str:
  return ', '.join(str(int(i)) for i in indices[:4]) + (', ...' if len(indices) > 4 else '')


def numeric(value, key: str, where: str) -> np.ndarray:
  """A field as a numeric numpy array, or one line naming what it is instead."""
  try:
    value = np.asarray(value)
  except ValueError as e:  # ragged nested lists
    raise DataError(f'{where}: field {key!r} is not one array ({first_line(e, 120)}); pad or '
                    'crop it to one shape in the source or a transform') from None
  if value.dtype.kind not in 'biuf' and value.dtype != ml_dtypes.bfloat16:  # bf16's kind is V
    kind = type(value.flat[0]).__name__ if value.size else value.dtype
    raise DataError(f'{where}: field {key!r} is {value.dtype} ({kind} values), not numbers; '
                    'turn it into a numeric array in the source or a transform (e.g. tokenize '
                    'text)')
  return value


def jax_dtype(value: np.ndarray, key: str, where: str) -> np.dtype:
  """The JAX dtype of a field (64-bit becomes 32-bit), checked to hold its values: int64 ids of
  2^40 would wrap to 0 and 1e300 become inf."""
  target = np.dtype(jax.dtypes.canonicalize_dtype(value.dtype))
  if target == value.dtype or not value.size:
    return target
  if value.dtype.kind in 'iu':
    info, low, high = np.iinfo(target), value.min(), value.max()
    bad = low if low < info.min else high if high > info.max else None
  else:
    finite = value[np.isfinite(value)]
    high = np.abs(finite).max() if finite.size else 0
    bad = high if high > np.finfo(target).max else None
  if bad is not None:
    raise DataError(f'{where}: field {key!r} holds {bad}, which {target} (what JAX computes '
                    f'in without x64) cannot hold; scale or remap it in the source or a transform')
  return target


def in_memory_arrays(arrays: dict, name: str) -> dict[str, np.ndarray]:
  """A dict of arrays as numpy arrays of JAX dtypes, all with one leading dimension."""
  if not is_in_memory(arrays):
    raise DataError(f'the {name} data is a dict whose values are not all arrays; pass a dict of '
                    'arrays (one in-memory source) or a random-access source')
  out = {}
  for key, value in arrays.items():
    value = np.asarray(value)
    if value.ndim == 0:
      raise DataError(f'in-memory {name} data: field {key!r} is a scalar; every field needs a '
                      'leading example dimension')
    value = numeric(value, key, f'in-memory {name} data')
    out[key] = value.astype(jax_dtype(value, key, f'in-memory {name} data'), copy=False)
  sizes = {k: len(v) for k, v in out.items()}
  if len(set(sizes.values())) > 1:
    first = next(iter(sizes))
    odd = next(k for k, n in sizes.items() if n != sizes[first])
    raise DataError(f'in-memory {name} data: field {odd!r} has {sizes[odd]} rows but {first!r} '
                    f'has {sizes[first]}; give every field the same leading dimension')
  return out

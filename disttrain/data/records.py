"""Random-access examples: any source of feature dicts, its per-example transforms, batched reads.

A source is anything with `__len__` and `__getitem__(int) -> dict[str, array]`: grain's
RandomAccessDataSource protocol, a `grain.MapDataset` (e.g. ArrayRecord files `.map(decode)`),
a `datasets.Dataset` in numpy format, or a dict of numpy arrays with a common leading dimension
(in memory; gathered with one fancy index per field). `Data(source, transforms)` adds grain
transformations (`grain.transforms.Map`, `RandomMap`, or plain functions of one example) applied
after disttrain's shuffle. A random transform draws from `np.random.default_rng([seed, epoch,
index])`: its randomness depends on the example, the epoch and the seed only, never on the
layout, the process or worker count, or a resume.

Every example must have the keys, shapes and dtypes of the first one (after transforms); 64-bit
dtypes become their 32-bit JAX equivalents. The pipeline adds the reserved fields MASK and ID.
"""

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np

from disttrain.data import fields
from disttrain.data.fields import is_array, is_in_memory
from disttrain.errors import DataError, first_line

MASK = '_mask'  # float32 [B]: 1 for real examples, 0 for eval padding
ID = '_id'  # int32 [B]: the example's index in its source; -1 for eval padding
RESERVED = (MASK, ID)


@dataclasses.dataclass(frozen=True)
class Data:
  """A source of feature dicts and the per-example transforms applied after the shuffle.

  `transforms`: grain.transforms.Map (deterministic: decoding, normalising), RandomMap
  (augmentation: `random_map(example, rng)`), or functions example -> example, in order.
  """
  source: Any
  transforms: Sequence[Any] = ()


def is_source(value: Any) -> bool:
  return isinstance(value, Data) or is_in_memory(value) or (
      hasattr(value, '__len__') and hasattr(value, '__getitem__') and not isinstance(value, dict))


def named_sources(eval_data: Any, default_name: str = 'eval') -> dict[str, Any]:
  """{'eval': src} for one source, the dict itself for several named sources ({'val': ..})."""
  if eval_data is None:
    return {}
  if isinstance(eval_data, dict) and not is_in_memory(eval_data):
    bad = [k for k, v in eval_data.items() if not is_source(v)]
    if not eval_data or bad or any(is_array(v) for v in eval_data.values()):
      raise DataError(f'eval_data is a dict of neither arrays (one in-memory source) nor sources '
                      f'(named eval sets; {bad[:1] or "empty"} is not one); pass one or the other')
    return dict(eval_data)
  return {default_name: eval_data}


def _transform_name(transform: Any) -> str:
  return getattr(transform, '__name__', type(transform).__name__)


class Records:
  """The examples of one source after its transforms; reads batches of them as stacked arrays."""

  def __init__(self, data: Any, name: str, seed: int, stream: tuple[int, ...] = ()):
    """Checks the source and derives the element spec from its first example.

    Args:
      data: a source (see module doc) or `Data(source, transforms)`.
      name: what the errors call it ('train', 'eval', 'val', ...).
      seed: the run's seed, for random transforms.
      stream: words added to the seed (a mixture source's name), so sources draw apart.
    """
    data = data if isinstance(data, Data) else Data(data)
    self.name, self.seed, self.source = name, [seed, *stream], data.source
    given = data.transforms
    one = given is None or callable(given) or isinstance(
        given, (grain.transforms.Map, grain.transforms.RandomMap))  # Data(source, MyMap())
    self.transforms = (() if given is None else (given,)) if one else tuple(given)
    for t in self.transforms:
      if isinstance(t, (grain.transforms.Filter, grain.transforms.Batch)) or not (
          isinstance(t, (grain.transforms.Map, grain.transforms.RandomMap)) or callable(t)):
        raise DataError(f'{name} transform {_transform_name(t)} is not a grain.transforms.Map, '
                        'RandomMap or function of one example; filters and batching would change '
                        'the number of examples, do them in the source')
    self._random = any(isinstance(t, grain.transforms.RandomMap) for t in self.transforms)
    # read() needs each example's epoch for transforms only (random draws, error messages).
    self.uses_epochs = bool(self.transforms)
    self._arrays = (fields.in_memory_arrays(self.source, name)
                    if isinstance(self.source, dict) else None)
    if self._arrays is None and not (hasattr(self.source, '__len__')
                                     and hasattr(self.source, '__getitem__')):
      raise DataError(f'the {name} data ({type(self.source).__name__}) has no __len__ and '
                      '__getitem__; pass a random-access source (e.g. grain.MapDataset.source(...)'
                      ', a list of dicts or a dict of arrays) so it can be shuffled and sharded')
    self._len = len(self.source) if self._arrays is None else len(next(iter(self._arrays.values())))
    if self._len == 0:
      raise DataError(f'the {name} data is empty; pass a source with at least one example')
    first = self._transformed(self._get([0])[0], 0, 0)
    if not isinstance(first, dict) or not first:
      raise DataError(f'example 0 of the {name} data is {type(first).__name__}, not a dict of '
                      'arrays; make the source (or the last transform) return {name: array}')
    clash = sorted(set(first) & set(RESERVED))
    if clash:
      raise DataError(f'the {name} data has a field {clash[0]!r}, a name disttrain reserves for '
                      f'its own fields {RESERVED}; rename it in the source or a transform')
    where = f'example 0 of the {name} data'
    first = {k: fields.numeric(v, k, where) for k, v in first.items()}
    self._raw_dtypes = {k: v.dtype for k, v in first.items()}
    self.spec = {k: jax.ShapeDtypeStruct(v.shape, fields.jax_dtype(v, k, where))
                 for k, v in first.items()}
    # The in-memory fast path gathers without transforms or per-example checks.
    self._fast = self._arrays is not None and not self.transforms

  def __len__(self) -> int:
    return self._len

  @property
  def kind(self) -> str:
    """What the source is, for the console: 'arrays' (in memory) or its type's name."""
    return 'arrays' if self._arrays is not None else type(self.source).__name__

  def read(self, indices: np.ndarray, epochs: np.ndarray | int = 0) -> dict[str, np.ndarray]:
    """Examples `indices` (epoch per example, for random transforms) stacked: {field: [n, ...]}."""
    indices = np.asarray(indices)
    if not indices.size:  # e.g. a process whose rows of the last eval batch are all padding
      return {k: np.zeros((0,) + s.shape, s.dtype) for k, s in self.spec.items()}
    if self._fast:
      return {k: a[indices] for k, a in self._arrays.items()}
    epochs = np.broadcast_to(np.asarray(epochs), indices.shape)
    examples = [self._transformed(ex, int(i), int(e))
                for ex, i, e in zip(self._get(indices), indices, epochs)]
    return self._stack(examples, indices)

  def _get(self, indices) -> list:
    """The source's examples at `indices`, batched where the source can (__getitems__)."""
    if self._arrays is not None:
      return [{k: a[i] for k, a in self._arrays.items()} for i in indices]
    try:
      getitems = getattr(self.source, '__getitems__', None)
      if getitems is not None and len(indices) > 1:
        return list(getitems([int(i) for i in indices]))
      return [self.source[int(i)] for i in indices]
    except DataError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (a damaged file, a failing reader)
      raise DataError(f'the {self.name} data ({type(self.source).__name__}) raised '
                      f'{type(e).__name__} reading examples {fields.shown(indices)}: '
                      f'{first_line(e, 200)}; '
                      'fix the source or its files') from e

  def _transformed(self, example, index: int, epoch: int):
    if not self.transforms:
      return example
    rng = np.random.default_rng([*self.seed, epoch, index]) if self._random else None
    for t in self.transforms:
      try:
        if isinstance(t, grain.transforms.RandomMap):
          example = t.random_map(example, rng)
        elif isinstance(t, grain.transforms.Map):
          example = t.map(example)
        else:
          example = t(example)
      except DataError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        raise DataError(f'{self.name} transform {_transform_name(t)} raised {type(e).__name__}: '
                        f'{first_line(e, 200)} (example {index}, epoch {epoch}); fix the '
                        'transform or that example') from e
    return example

  def _stack(self, examples: list, indices: np.ndarray) -> dict[str, np.ndarray]:
    for example, index in zip(examples, indices):
      if not isinstance(example, dict) or example.keys() != self.spec.keys():
        got = sorted(example) if isinstance(example, dict) else type(example).__name__
        raise DataError(f'example {index} of the {self.name} data has fields {got}, but example 0 '
                        f'has {sorted(self.spec)}; give every example the same fields')
      for key, value in example.items():
        shape, dtype = np.shape(value), np.asarray(value).dtype
        if shape != self.spec[key].shape or dtype != self._raw_dtypes[key]:
          raise DataError(
              f'example {index} of the {self.name} data: field {key!r} is {dtype}{list(shape)} '
              f'but in example 0 it is {self._raw_dtypes[key]}{list(self.spec[key].shape)}; '
              'make every example the same shape and dtype (pad, crop or cast in a transform)')
    out = {}
    for k, spec in self.spec.items():
      stacked = np.stack([np.asarray(ex[k]) for ex in examples])
      if stacked.dtype != spec.dtype:
        fields.jax_dtype(stacked, k, f'examples {fields.shown(indices)} of the {self.name} data')
      out[k] = stacked.astype(spec.dtype, copy=False)
    return out


class Slice:
  """Examples start..stop-1 of a source, as a source (e.g. a held-out tail for eval)."""

  def __init__(self, source: Any, start: int, stop: int):
    self.source, self.start, self.stop = source, start, stop

  def __len__(self) -> int:
    return self.stop - self.start

  def __getitem__(self, index: int):
    if not 0 <= index < len(self):
      raise IndexError(index)
    return self.source[self.start + int(index)]

  def __getitems__(self, indices) -> list:
    """A batch in one read where the source can (ArrayRecord files: grain's batched read)."""
    shifted = [self.start + int(i) for i in indices]
    getitems = getattr(self.source, '__getitems__', None)
    return list(getitems(shifted)) if getitems else [self.source[i] for i in shifted]


def num_examples(source: Any) -> int | None:
  """len() of a source (rows of a dict of arrays); None for an iterable without one."""
  if isinstance(source, dict):
    return len(next(iter(fields.in_memory_arrays(source, 'the').values())))
  return len(source) if hasattr(source, '__len__') else None


def examples(source: Any) -> Iterator[dict]:
  """Every example of a source (dict of arrays, random-access source or iterable), in order."""
  if isinstance(source, Data):
    raise DataError('examples() reads a source, not Data with transforms; pass Data.source')
  if isinstance(source, dict):
    arrays = fields.in_memory_arrays(source, 'the')
    for i in range(len(next(iter(arrays.values())))):
      yield {k: a[i] for k, a in arrays.items()}
  elif hasattr(source, '__len__') and hasattr(source, '__getitem__'):
    for i in range(len(source)):
      yield source[i]
  else:
    yield from source

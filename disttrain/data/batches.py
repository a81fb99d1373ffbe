"""Input pipeline: records of any source -> grain stream of per-process rows -> global jax.Arrays.

The train stream is a pure function of (seed, global batch index): batch k belongs to epoch
k // batches_per_epoch, whose permutation depends on (seed, epoch) only. Each process reads just
the rows of the global batch that its addressable devices hold, so the global batches are the same
on 1 device, 8 devices or a pod; only who reads which rows changes. Batches, not records, are
grain's elements; with data.workers=N they are read (and transformed) in N worker processes and
put on the devices in this process, in the same order, so the worker count is not part of the
data order. The iterator state is the number of batches delivered.
"""

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from absl import flags
import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from disttrain import moved
from disttrain.data.global_arrays import Assembler, Batch
from disttrain.data.records import ID, MASK, Records
from disttrain.errors import DataError, first_line

_STATE_VERSION = 2
# Names that moved to another module resolve there, with a DeprecationWarning.
__getattr__ = moved.names(__name__, {})


class _ReadTrainBatches:
  """Element e -> this process's rows of global batches e K .. e K + K - 1, as numpy arrays.

  Runs in grain's reader thread or in a worker process (it is pickled there with its records).
  """

  def __init__(self, records: Records, batch_size: int, seed: int, rows: np.ndarray, k: int):
    """Keeps the records and this process's row offsets within a global batch."""
    self.records, self.batch_size, self.seed, self.rows, self.k = records, batch_size, seed, rows, k
    self.batches_per_epoch = len(records) // batch_size
    self._perm = (-1, None)  # (epoch, permutation); one tuple so a reader never sees a mix
    # One block of rows (one process, or one host's slice of the batch axis): a slice will do.
    block = rows.size and rows[-1] - rows[0] + 1 == rows.size
    self._block = (int(rows[0]), int(rows[-1]) + 1) if block else None

  def permutation(self, epoch: int) -> np.ndarray:
    """The epoch's example order, a function of (seed, epoch) only."""
    cached_epoch, perm = self._perm
    if cached_epoch != epoch:
      perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.records))
      self._perm = (epoch, perm)
    return perm

  def __call__(self, element: int) -> dict[str, np.ndarray]:
    """[rows, ...] per field for K = 1, else [K, rows, ...]: one read for all K batches."""
    batches = range(int(element) * self.k, (int(element) + 1) * self.k)
    index = self._index(batches[0]) if self.k == 1 else np.concatenate(
        [self._index(b) for b in batches])
    epochs = 0
    if self.records.uses_epochs:
      epochs = np.repeat([b // self.batches_per_epoch for b in batches], self.rows.size)
    batch = self.records.read(index, epochs)
    batch.setdefault(ID, index.astype(np.int32))  # a mixture sets its own; no MASK: all real
    if self.k == 1:
      return batch
    return {key: v.reshape((self.k, self.rows.size) + v.shape[1:]) for key, v in batch.items()}

  def _index(self, b: int) -> np.ndarray:
    """Example indices of this process's rows of global batch b (a mixture: the rows' global
    numbers, which its schedule maps to sources and examples)."""
    if getattr(self.records, 'scheduled', False):
      return b * self.batch_size + self.rows
    epoch, step = divmod(b, self.batches_per_epoch)
    if self._block is not None:
      start = step * self.batch_size
      return self.permutation(epoch)[start + self._block[0]:start + self._block[1]]
    return self.permutation(epoch)[step * self.batch_size + self.rows]


def _worker_init(worker_index: int, worker_count: int) -> None:
  """Each worker ends when this process does, even by SIGKILL: grain's workers have no
  parent-death check, and PR_SET_PDEATHSIG would fire when grain's starting thread ends."""
  del worker_index, worker_count
  parent = os.getppid()

  def watch() -> None:
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(1)
  threading.Thread(target=watch, name='disttrain-parent-watch', daemon=True).start()


class _InWorker:
  """Wraps the batch reader for worker processes: an exception crosses the process boundary as
  a DataError carrying its text (grain hangs on exceptions it cannot pickle back)."""

  def __init__(self, read: Callable[[int], dict]):
    self.read = read

  def __call__(self, element: int) -> dict[str, np.ndarray]:
    try:
      return self.read(element)
    except DataError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f'reading train batch {element} in a worker process raised '
                      f'{type(e).__name__}: {first_line(e)}; fix the source or set data.workers=0 '
                      'to see the full traceback') from None


class TrainIterator:
  """Infinite, resumable stream of shuffled global train batches (dicts of jax.Arrays)."""

  def __init__(self, records: Records, global_batch_size: int, seed: int,
               sharding: NamedSharding, prefetch: int = -1, batches_per_element: int = 1,
               workers: int = 0):
    """Checks the sizes; the stream starts on the first next() (after any set_state).

    With batches_per_element=K each element is K consecutive global batches stacked on a new
    leading axis ([K, B, ...], for steps_per_dispatch=K); positions stay counted in batches.
    With workers=N, reading and transforms run in N processes (grain mp_prefetch). prefetch:
    batches read ahead in a thread; -1 = 0 on CPU devices (where XLA's step already uses every
    core, so a reader thread slows it down more than it hides) and 2 on accelerators.
    """
    if prefetch == -1:
      prefetch = 0 if sharding.mesh.devices.flat[0].platform == 'cpu' else 2
    if len(records) < global_batch_size:
      raise DataError(f'the train data has {len(records)} examples, fewer than global_batch_size='
                      f'{global_batch_size}; pass --config.global_batch_size=N with N <= '
                      f'{len(records)} or use more data')
    self._assemble = Assembler(sharding, global_batch_size)
    self._read = _ReadTrainBatches(records, global_batch_size, seed, self._assemble.rows,
                                   batches_per_element)
    self.batches_per_epoch = self._read.batches_per_epoch
    self._key = {'seed': seed, 'global_batch_size': global_batch_size,
                 'num_examples': len(records)}
    # A mixture's sources may change between restarts (its state checks them, source by source).
    self._mixture = records if getattr(records, 'scheduled', False) else None
    if self._mixture is not None:
      del self._key['num_examples']
    self.changed = ''  # set_state: a line for the console when a mixture's weights changed
    self._k, self._prefetch, self._workers = batches_per_element, prefetch, workers
    self._next = 0  # batches delivered so far: the whole iterator state
    self._it = None

  def _start(self) -> None:
    """The grain stream from element self._next // K on."""
    k = self._k
    batch_axis = 0 if k == 1 else 1
    if not self._workers and not self._prefetch:
      # Read in this thread, when the step asks: no grain machinery is needed for that.
      self._it = (self._assemble(self._read(e), batch_axis=batch_axis)
                  for e in itertools.count(self._next // k))
      return
    elements = grain.MapDataset.range(self._next // k, sys.maxsize // k)
    if not self._workers:
      # Reading and the host-to-device copy both happen in grain's thread: on the main thread
      # the copy cost about as much as a small step.
      stream = elements.map(self._read).map(
          lambda local: self._assemble(local, batch_axis=batch_axis)).to_iter_dataset(
              grain.ReadOptions(num_threads=1, prefetch_buffer_size=self._prefetch))
      self._it = iter(stream)
      return
    # Workers read and transform; each reads one element ahead in one thread (grain's default
    # would be 16 threads and 500 elements ahead). Their arrays arrive in shared memory, which
    # device arrays must not alias, so assemble copies, in grain's prefetch thread here.
    if not flags.FLAGS.is_parsed():  # grain's workers read an absl flag of their own
      flags.FLAGS.mark_as_parsed()
    # Batches still in flight when a run ends (an error, a stop) leave shared memory that
    # multiprocessing's resource tracker then frees, with a warning per run on stderr that
    # would break one-line errors. The tracker, started with the workers, reads this.
    os.environ.setdefault('PYTHONWARNINGS', 'ignore:resource_tracker:UserWarning')
    stream = elements.map(_InWorker(self._read)).to_iter_dataset(
        grain.ReadOptions(num_threads=1, prefetch_buffer_size=1)).mp_prefetch(
            grain.MultiprocessingOptions(num_workers=self._workers,
                                         per_worker_buffer_size=max(self._prefetch, 1)),
            worker_init_fn=_worker_init).map(
                lambda local: self._assemble(local, batch_axis=batch_axis, copy=True))
    if self._prefetch:
      stream = grain.experimental.ThreadPrefetchIterDataset(
          stream, prefetch_buffer_size=self._prefetch)
    self._it = iter(stream)

  def __iter__(self) -> 'TrainIterator':
    """The iterator itself."""
    return self

  def __next__(self) -> Batch:
    """The next global batch (or K of them, stacked)."""
    if self._it is None:
      self._start()
    try:
      batch = next(self._it)
    except DataError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      if not self._workers:
        raise
      raise DataError(f'data.workers={self._workers}: the worker processes failed '
                      f'({type(e).__name__}: {first_line(e)}); the source and transforms must be '
                      'picklable (defined at the top level of an importable module) and a script '
                      "that trains needs `if __name__ == '__main__':` around it (workers import "
                      'it): fix them, or set data.workers=0 to read in this process') from e
    self._next += self._k
    return batch

  def close(self) -> None:
    """Stops the reader thread or worker processes (a later next() starts them again)."""
    it, self._it = self._it, None
    if it is not None and hasattr(it, 'close'):
      it.close()

  def get_state(self) -> dict:
    """JSON-serialisable position: the next batch to deliver plus what the order depends on."""
    state = {'version': _STATE_VERSION, **self._key, 'next_batch': self._next}
    if self._mixture is not None:
      state['mixture'] = self._mixture.get_state(self._next)
    return state

  def set_state(self, state: dict) -> None:
    """Resumes at the position recorded by get_state on an iterator with the same settings."""
    if not isinstance(state, dict) or state.get('version') not in (1, _STATE_VERSION) or not (
        'next_batch' in state or 'next_index' in state.get('grain', {})):
      raise DataError(f'data iterator state {state!r} is not from TrainIterator.get_state '
                      f'version {_STATE_VERSION}; restore a checkpoint written by this version')
    if ('mixture' in state) != (self._mixture is not None):
      read, runs = ('a data.mixture', 'one source') if 'mixture' in state else (
          'one source', 'a data.mixture')
      raise DataError(f'the checkpoint read {read}, this run {runs}; resume with the same data '
                      'or start a new run')
    for name, value in self._key.items():
      if state.get(name) != value:
        raise DataError(f'data iterator state has {name}={state.get(name)!r} but this run has '
                        f'{value!r}; resume with the same {name} or start a new run')
    # Version 1 kept grain's own position, which also counted batches.
    position = state['next_batch'] if 'next_batch' in state else state['grain']['next_index']
    if position % self._k:
      raise DataError(f'data iterator state is at batch {position}, not a multiple of '
                      f'steps_per_dispatch={self._k}; resume with a steps_per_dispatch that '
                      'divides it')
    self.close()
    self._next = position
    if self._mixture is not None:
      self.changed = self._mixture.set_state(state['mixture'], position)


class _ReadEvalBatch:
  """Eval batch b -> this process's rows, the last batch padded (zeros, mask 0, id -1)."""

  def __init__(self, records: Records, batch_size: int, rows: np.ndarray):
    self.records, self.batch_size, self.rows = records, batch_size, rows

  def __call__(self, b: int) -> dict[str, np.ndarray]:
    index = int(b) * self.batch_size + self.rows
    real = index < len(self.records)
    if real.all():
      batch = self.records.read(index)
    else:  # padding rows are zeros of every field, whatever the fields are
      part = self.records.read(index[real])
      batch = {k: np.zeros((index.size,) + s.shape, s.dtype) for k, s in self.records.spec.items()}
      for key, value in part.items():
        batch[key][real] = value
    batch[MASK] = real.astype(np.float32)
    batch[ID] = np.where(real, index, -1).astype(np.int32)
    return batch


def eval_batches(records: Records, batch_size: int, sharding: NamedSharding) -> Iterator[Batch]:
  """Every example exactly once in source order; the last batch is padded with mask 0 (also when
  the whole set is smaller than one device's rows: devices then hold padding only)."""
  assemble = Assembler(sharding, batch_size)
  count = -(-len(records) // batch_size)
  read = _ReadEvalBatch(records, batch_size, assemble.rows)
  # Read ahead in grain's thread, as for training; eval sets are usually small, so no workers.
  stream = grain.MapDataset.range(count).map(read).map(assemble).to_iter_dataset(
      grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
  yield from stream


def element_spec(records: Records) -> dict[str, jax.ShapeDtypeStruct]:
  """A one-example batch's shapes and dtypes, reserved fields included: what init traces with."""
  spec = {k: jax.ShapeDtypeStruct((1,) + s.shape, s.dtype) for k, s in records.spec.items()}
  spec[MASK] = jax.ShapeDtypeStruct((1,), np.float32)
  spec[ID] = jax.ShapeDtypeStruct((1,), np.int32)
  return spec

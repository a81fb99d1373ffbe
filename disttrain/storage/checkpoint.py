"""Orbax checkpoints under DIR/checkpoints: TrainState + data iterator state + run metadata.

Saves are asynchronous; their errors are raised at the next save or at close, never swallowed.
A save torn by a kill stays an orbax temporary directory, is never listed as a step, and is
cleaned up when the next run opens the manager. Restores build the abstract state with the
*current* mesh's shardings and let orbax reshard. A latest checkpoint that fails to restore while
an older one restores is moved aside to DIR/checkpoints/corrupt/ (kept for inspection, never
deleted) and the older one is used; if none restores, nothing is moved and the error is raised.
Nothing here deletes a complete checkpoint: only keep-N retention does. In a bucket (gs://, s3://;
storage/urls.py) a step commits by its marker file instead of a rename: a step without it is never
listed and is cleaned up like a local temporary directory.
"""

import contextlib
import errno
import inspect
import logging as std_logging
import math
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from absl import logging
from orbax.checkpoint.checkpoint_managers import preservation_policy as policies

from disttrain.config import Config
from disttrain.errors import CheckpointError, first_line
from disttrain.parallel import sharding as sharding_lib, state as state_lib
from disttrain.storage import local_tier, urls

ITEMS = ('state', 'data', 'meta')


# orbax writes a replicated array as one slice per replica ("replica parallel") and compiles a
# slice program per (shape, device) at a process's first save: 2.2 s for an 8-device MLP of a few
# hundred KB (0.05 s whole). Slices under 1 MiB gain nothing from parallel writes, so one replica
# writes those arrays whole; large ones stay split.
MIN_REPLICA_SLICE_BYTES = 2**20
# orbax 0.11.20 (the oldest supported) has no threshold: there every replicated array is split.
HAS_SLICE_THRESHOLD = 'min_slice_bytes_for_replica_parallel' in inspect.signature(
    ocp.type_handlers.ArrayHandler).parameters


def _whole_small_arrays() -> None:
  """Re-registers orbax's jax.Array handler (its process-wide registry) with that threshold,
  unless the handler there is not orbax's own (a user's registration is kept) or this orbax has
  no threshold (its handler stays)."""
  current = ocp.type_handlers.get_type_handler(jax.Array)
  if (HAS_SLICE_THRESHOLD and type(current) is ocp.type_handlers.ArrayHandler
      and not getattr(current, 'disttrain', False)):
    handler = ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
        array_metadata_store=getattr(current, '_array_metadata_store', None))
    handler.disttrain = True
    absl_logger = logging.get_absl_logger()  # its "overriding jax.Array" note: not the user's
    level = absl_logger.level
    absl_logger.setLevel(std_logging.ERROR)
    try:
      ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
      absl_logger.setLevel(level)


def _handlers() -> dict:
  # Registered up front so that metadata (shapes) can be read before anything is saved.
  return {'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler(),
          'meta': ocp.JsonCheckpointHandler()}


class _Manager(ocp.CheckpointManager):
  """Orbax's manager without its own preemption check: disttrain agrees on stops itself
  (distributed.StopSignals counts calls to jax's preemption sync point; orbax would pass it step
  numbers, and after a resume a signal's agreed call would never come)."""

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


def abstract_like(shardings: Any, shapes: Any) -> Any:
  """ShapeDtypeStructs carrying the current layout's shardings: orbax reshards into them."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


class Checkpointer:
  """One run's checkpoints: save every N steps and at the end, keep N (and the best), restore."""

  def __init__(self, workdir: str, cfg: Config):
    _whole_small_arrays()
    self.directory = urls.join(urls.resolve(workdir), 'checkpoints')
    if urls.path(self.directory).is_file():  # orbax: a NotADirectoryError traceback
      raise CheckpointError(f'{self.directory} is a file, not the run\'s checkpoints directory; '
                            'move it aside or pass another --workdir')
    keep = [policies.LatestN(n=cfg.max_to_keep)]
    # Steps saved with other metrics (a relaunch that names a new eval source) rank last: a
    # KeyError inside orbax failed every save, each relaunch keeping one more step.
    worst = -math.inf if cfg.best_mode == 'max' else math.inf
    metric = (lambda m: m.get(cfg.best_metric, worst)) if cfg.best_metric else None
    if metric:
      keep.append(policies.BestN(get_metric_fn=metric, reverse=cfg.best_mode == 'min', n=1,
                                 keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policies.AnyPreservationPolicy(keep),
        # orbax writes a step's metrics (and reads them back after a relaunch) only with best_fn.
        best_fn=metric,
        best_mode=cfg.best_mode,
        cleanup_tmp_directories=True,  # torn saves from killed runs
        enable_async_checkpointing=True,
        # Object stores have no atomic rename: commit by marker (orbax does so for gs:// itself).
        temporary_path_class=(ocp.path.atomicity.CommitFileTemporaryPath
                              if urls.is_bucket(self.directory) else None))
    self._manager = _Manager(self.directory, options=options,
                                          item_handlers=_handlers())
    # orbax deletes torn saves in a background thread that only its next save waits for: finish
    # it now, before steps are listed, and so that a run ending early (bad input) does not exit
    # under it (the thread then prints a RuntimeError traceback).
    getattr(self._manager, '_maybe_await_cleanup_tmp_directory', lambda: None)()
    self._started: list[int] = []  # steps whose save was started, oldest first
    self._need: int | None = None  # bytes a save needs at most (set by the first save)
    self.local = (local_tier.LocalTier(cfg.local_checkpoint_dir, workdir)
                  if cfg.local_checkpoint_every_steps else None)
    self.restored_from = ''  # after restore_latest: 'persistent' or 'local' (the fast tier)

  def steps(self) -> list[int]:
    """Complete checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: dict, meta: dict,
           metrics: dict | None = None) -> None:
    """Starts an async save; raises the error of an earlier async save if it failed."""
    state = state_lib.saved_part(state)  # frozen inputs come from their source, not from here
    with self._named_failures():
      self._manager.check_for_errors()
      # orbax waits for the previous save before starting this one: wait first, so the space
      # check sees the disk after it (not while it is still writing).
      self._manager.wait_until_finished()
      self._check_space(step, state)
      self._started.append(step)
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
          meta=ocp.args.JsonSave(meta)), metrics=metrics, force=True)

  def save_local(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
    """A fast-tier save (local_tier.py): the arrays reach host memory before it returns."""
    self.local.save(step, state_lib.saved_part(state), {'data': data_state, 'meta': meta})

  def wait(self) -> None:
    """Blocks until every started save has committed; raises its error if one failed."""
    with self._named_failures():
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    if self.local is not None:
      self.local.wait()

  def close(self) -> None:
    self.wait()
    self._manager.close()
    if self.local is not None:
      self.local.close()

  def _check_space(self, step: int, state: Any) -> None:
    """A save that cannot fit is refused before orbax starts it (and fails noisily)."""
    if self._need is None:  # the state's shapes never change within a run
      self._need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
      self._need += 2**16  # metadata and the data iterator's state; arrays are stored at most raw
    try:
      free = -1 if urls.is_bucket(self.directory) else shutil.disk_usage(self.directory).free
    except OSError:  # not made yet: the save itself will tell
      free = -1
    if jax.process_count() > 1:  # every process must take process 0's decision
      free = float(multihost_utils.broadcast_one_to_all(np.float32(free / 2**20))) * 2**20
    if 0 <= free < self._need:
      raise self._no_space(step, f'needs about {self._need / 2**20:,.1f} MiB but '
                                 f'{free / 2**20:,.1f} MiB are free', self.steps())

  def _no_space(self, step: int, why: str, done) -> CheckpointError:
    last = (f'the last complete checkpoint is step {max(done)}, kept' if done else
            'no checkpoint has completed yet')
    return CheckpointError(f'saving checkpoint step {step} to {self.directory} {why}; {last}: '
                           'free space there (or lower max_to_keep), then relaunch with the '
                           'same --workdir')

  @contextlib.contextmanager
  def _named_failures(self):
    """A save that ran out of space is one line naming the step, the directory and the newest
    checkpoint that did commit (orbax reports it as a multi-line RESOURCE_EXHAUSTED error)."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      if getattr(e, 'errno', None) != errno.ENOSPC and 'No space left on device' not in str(e):
        raise
      self._manager.reload()
      done = set(self._manager.all_steps())
      # The first step started after the newest that committed (older ones retention deleted).
      failed = min((s for s in self._started if s > max(done, default=-1)),
                   default=self._started[-1])
      raise self._no_space(failed, 'failed: no space left on device', done) from None

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict, dict, int] | None:
    """(state, data state, meta, step) of the newest checkpoint that restores; None if none.

    A newer step that fails while an older one restores under the same conditions is unreadable
    and is moved aside; if no step restores (out of memory, permissions, storage down, ...)
    nothing is moved and the error is raised, so a relaunch never silently starts over.
    """
    abstract_state = state_lib.saved_part(abstract_state)  # restored without frozen inputs
    persistent = self.steps()
    if self.local is not None:
      found = self.local.newest_complete(abstract_state)
      if found is not None and found[0] >= max(persistent, default=0):
        step, missing = found
        state, extra = self.local.restore(step, missing, abstract_state)
        self.local.forget_after(step)
        self.restored_from = 'local'
        if missing and jax.process_index() == 0:
          print(f'fast tier: process(es) {missing} had no copy of step {step}; their shards '
                'came from their peers\' copies', flush=True)
        return state, extra['data'], extra['meta'], step
      self.local.forget_after(max(persistent, default=0))
    self.restored_from = 'persistent'
    failures = []
    for step in reversed(persistent):
      check_fits(self._manager, step, abstract_state, self.directory)
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        failures.append((step, f'{type(e).__name__}: {first_line(e, 200)}'))
        continue
      if failures:
        self._quarantine([s for s, _ in failures])
        logging.warning('checkpoint step %s in %s could not be restored (%s); fell back to step '
                        '%d', failures[0][0], self.directory, failures[0][1], step)
        print(f'warning: checkpoint step {failures[0][0]} is corrupt ({failures[0][1]}); moved '
              f'to {self.directory}/corrupt/, resuming from step {step} instead', flush=True)
      return restored['state'], restored['data'], restored['meta'], step
    if failures:
      raise CheckpointError(f'no checkpoint in {self.directory} could be restored (steps '
                            f'{[s for s, _ in failures]}, first error: {failures[0][1]}); they '
                            'are left in place: fix the cause (memory, permissions, storage) and '
                            'relaunch, or use another workdir')
    return None

  def _quarantine(self, steps: list[int]) -> None:
    """Moves unreadable steps aside (never deleted) so later saves can reuse their numbers."""
    if jax.process_index() == 0:
      for step in steps:
        target = urls.join(self.directory, 'corrupt', f'{step}-{int(time.time())}')
        try:
          urls.move_tree(urls.join(self.directory, str(step)), target)
        except OSError as e:
          raise CheckpointError(f'checkpoint step {step} in {self.directory} cannot be restored '
                                f'and moving it to {target} failed ({first_line(e, 200)}); move '
                                'or delete that step by hand and relaunch') from e
    if jax.process_count() > 1:  # every process must see the moves before listing steps again
      multihost_utils.sync_global_devices('disttrain_checkpoint_quarantine')
    self._manager.reload()


def check_fits(manager: ocp.CheckpointManager, step: int, abstract_state: Any, where: str,
               only: tuple[str, ...] = ()) -> None:
  """One-line error naming the first parameter (then other leaf) whose shape or presence differs;
  `only`: the parts of the saved state compared (a warm start reads params and mutable), else all."""
  try:
    saved = manager.item_metadata(step)['state'].tree
  except Exception:  # pylint: disable=broad-except
    return  # unreadable metadata: a corrupt checkpoint, which restore reports and falls back from
  expected = {sharding_lib.path_str(p): tuple(x.shape)
              for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
  found = {sharding_lib.path_str(p): tuple(x.shape)
           for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]}
  elsewhere = 'another restore_from' if only else 'another workdir'
  fix = elsewhere if only else f'the config it was saved with or {elsewhere}'
  if only:
    found = {k: v for k, v in found.items() if k.split('/', 1)[0] in only}
  # Parameters first: a model mismatch is named by its parameter, not by the optimizer's copy.
  for path, shape in sorted(expected.items(), key=lambda item: not item[0].startswith('params')):
    if path not in found:
      other = ('another optimizer (optimizer, grad_clip_norm, ema_decay, ... differ)'
               if path.startswith('opt_state') else 'another model')
      raise CheckpointError(f'checkpoint {where}/{step} has no {path} (config expects shape '
                            f'{shape}); it was saved for {other}: use a matching config or '
                            f'{elsewhere}')
    if found[path] != shape:
      raise CheckpointError(f'checkpoint {where}/{step}: {path} has shape {found[path]} but the '
                            f'config expects {shape}; use {fix}')
  extra = sorted(set(found) - set(expected))
  if extra:
    raise CheckpointError(f'checkpoint {where}/{step} has {extra[0]} {found[extra[0]]}, which the '
                          f'config does not; use {fix}')


def read_only(directory: str) -> ocp.CheckpointManager:
  """A manager that lists and reads committed steps only: in a bucket, a step without its commit
  marker (a save under way, or killed) looked complete to the default check."""
  return _Manager(directory, item_handlers=_handlers(), options=ocp.CheckpointManagerOptions(
      read_only=True, temporary_path_class=(ocp.path.atomicity.CommitFileTemporaryPath
                                            if urls.is_bucket(directory) else None)))

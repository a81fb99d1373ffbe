"""A run's checkpoints read outside its training loop: the config a step was saved with
(disttrain generate, export, compare, lm-eval), a warm start's parameters from another run
(restore_from), and part of a saved state (params, a LoRA run's adapters, optimizer moments)
resharded onto the reader's mesh. Only committed steps are listed (storage/checkpoint.py's
read-only manager); a damaged step is one line naming an older step to pass.
"""

from typing import Any

import orbax.checkpoint as ocp

from disttrain.errors import CheckpointError, first_line
from disttrain.storage import urls
from disttrain.storage.checkpoint import check_fits, read_only


def restore_params(path: str, abstract_state: Any) -> tuple[Any, Any, int]:
  """(params, mutable, step) from another run's checkpoint, for fine-tuning / warm starts.

  `path` is a checkpoints directory (its latest step is used) or one step directory in it.
  """
  path = urls.resolve(path)
  directory, step = path, None
  if path.rstrip('/').rsplit('/', 1)[-1].isdigit():
    directory, step = path.rsplit('/', 1)[0], int(path.rsplit('/', 1)[-1])
  if not urls.path(directory).is_dir():
    what = 'is a file' if urls.path(directory).exists() else 'does not exist'
    raise CheckpointError(f'restore_from={path!r} {what}; pass a checkpoints directory '
                          'or one of its step directories')
  manager = read_only(directory)
  step = manager.latest_step() if step is None else step
  if step is None or step not in manager.all_steps():
    raise CheckpointError(f'restore_from={path!r} holds no complete checkpoint; pass a '
                          'checkpoints directory or one of its step directories')
  # Parameters only: the optimizer starts fresh, so its state may be another optimizer's.
  part = {'params': abstract_state.params, 'mutable': abstract_state.mutable}
  check_fits(manager, step, part, directory, only=tuple(part))
  manager.close()
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        urls.join(directory, str(step), 'state'), args=ocp.args.PyTreeRestore(
            item=part, restore_args=ocp.checkpoint_utils.construct_restore_args(part),
            partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except  (truncated or missing array files)
    raise CheckpointError(f'restore_from={path!r}: step {step} cannot be read ({type(e).__name__}: '
                          f'{first_line(e, 200)}); pass another step directory') from None
  return restored['params'], restored['mutable'], step


def _steps_dir(workdir: str) -> str:
  directory = urls.join(urls.resolve(workdir), 'checkpoints')
  if not urls.path(directory).is_dir():
    raise CheckpointError(f'--workdir={workdir!r} has no checkpoints directory; pass the workdir '
                          'of a run that saved a checkpoint')
  return directory


def run_config(workdir: str, step: int | None = None) -> tuple[dict, int]:
  """(the config dict a run's checkpoint was saved with, its step): the latest, or `step`."""
  directory = _steps_dir(workdir)
  manager = read_only(directory)
  steps = sorted(manager.all_steps())
  if not steps or (step is not None and step not in steps):
    raise CheckpointError(f'{directory} has no complete checkpoint'
                          + (f' at step {step} (it has {steps})' if steps else '')
                          + '; pass the workdir of a run that saved one, or one of its steps')
  step = steps[-1] if step is None else step
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  except Exception as e:  # pylint: disable=broad-except  (a damaged step: training falls back)
    raise _unreadable(directory, step, steps, e) from None
  manager.close()
  return meta['config'], step


def _unreadable(directory: str, step: int, steps: list[int], e: Exception) -> CheckpointError:
  older = [s for s in steps if s < step]
  return CheckpointError(f'{directory}/{step} cannot be read ({type(e).__name__}: '
                         f'{first_line(e, 200)}); '
                         + (f'pass --step={older[-1]} (an older one)' if older else
                            'it is the only step: retrain or restore it from a copy'))


def restore_subtree(workdir: str, step: int, abstract: dict) -> dict:
  """Part of a saved TrainState, e.g. {'params': ShapeDtypeStructs with shardings}: only those
  arrays are read (no optimizer state), resharded onto the given shardings."""
  directory = _steps_dir(workdir)
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  try:
    return ocp.PyTreeCheckpointer().restore(
        urls.join(directory, str(step), 'state'), args=ocp.args.PyTreeRestore(
            item=abstract, restore_args=restore_args, partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except  (truncated or missing array files)
    raise _unreadable(directory, step, sorted(read_only(directory).all_steps()), e) from None

"""Shared test helpers: configs with dotted overrides, small layouts."""

import runpy
import sys

import jax
import numpy as np

from disttrain import config as config_lib

# Each layout: (name, config overrides, devices). All on the same global batches as 1 device.
LAYOUTS = {
    'replicate8': ({'mesh.data': 8}, 8),
    'fsdp8': ({'mesh.data': 1, 'mesh.fsdp': 8, 'sharding': 'fsdp'}, 8),
    'data4_tensor2': ({'mesh.data': 4, 'mesh.tensor': 2}, 8),
    'shard_map8': ({'mesh.data': 8, 'step_mode': 'shard_map'}, 8),
    'pmap8': ({'mesh.data': 8, 'step_mode': 'pmap'}, 8),
}


def override(cd, overrides: dict):
  """Sets fields of a ConfigDict; keys are 'a.b' or 'a__b' (keyword-argument friendly)."""
  for key, value in overrides.items():
    node = cd
    *parents, leaf = key.replace('__', '.').split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  return cd


def sgd_config(cfg: config_lib.Config, lr: float, **overrides) -> config_lib.Config:
  """cfg with plain SGD at the constant learning rate `lr` (no warm-up, momentum or weight decay):
  one step sets the parameters to p - lr x g, so the one-step tests read the gradient off them."""
  cd = override(config_lib.defaults(cfg), {
      'optimizer': 'sgd', 'learning_rate': lr, 'lr_schedule': 'constant', 'warmup_steps': 0,
      'weight_decay': 0.0, 'momentum': 0.0, **overrides})
  return config_lib.from_config_dict(cd)


def config_file(path):
  """get_config() of a launch/configs/*.py file, as launch/train.py loads it."""
  return runpy.run_path(str(path))['get_config']()


def config_file_arg(path, arg: str):
  """get_config(arg) of a config file: what --config=FILE:arg gives."""
  return runpy.run_path(str(path))['get_config'](arg)


def make_config(**overrides) -> config_lib.Config:
  """The mnist_mlp example config on digits with `a__b=value` meaning field a.b."""
  cd = config_lib.defaults()
  cd.logical_rules = (('hidden', 'tensor'),)
  cd.global_batch_size = 64
  return config_lib.from_config_dict(override(cd, overrides))


def devices(n: int):
  return jax.devices()[:n]


def to_numpy(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def assert_trees_close(actual, expected, rtol, atol, what):
  """Leaf by leaf, paths named in the message; both trees must have the same structure."""
  flat_actual, tree_a = jax.tree_util.tree_flatten_with_path(actual)
  flat_expected, tree_e = jax.tree_util.tree_flatten_with_path(expected)
  assert tree_a == tree_e, (tree_a, tree_e)
  for (path, a), (_, e) in zip(flat_actual, flat_expected):
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol,
                               err_msg=f'{what} {jax.tree_util.keystr(path)}')


def tensorboard_scalars(workdir, tag: str) -> dict[int, float]:
  """step -> value of a scalar, as TensorBoard's own event reader shows it (purges applied);
  fails if a step has two values."""
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  reader = event_accumulator.EventAccumulator(str(workdir), size_guidance={'scalars': 0})
  reader.Reload()
  scalars = reader.Scalars(tag)
  steps = [s.step for s in scalars]
  assert len(steps) == len(set(steps)), f'{tag}: steps shown twice: {sorted(steps)}'
  return {s.step: s.value for s in scalars}


def metrics_records(workdir, split: str = 'train') -> list[dict]:
  """metrics.jsonl's records of `split` in file order (a reader that takes the file as it is),
  from a local workdir or a bucket."""
  import json  # pylint: disable=g-import-not-at-top
  from disttrain.storage import urls  # pylint: disable=g-import-not-at-top
  text = urls.read_text(urls.join(str(workdir), 'metrics.jsonl'))
  return [r for r in map(json.loads, text.splitlines()) if r['split'] == split]


def saved_params(workdir, step: int) -> list[np.ndarray]:
  """The parameter leaves of WORKDIR's checkpoint `step` as numpy arrays, whatever the mesh or
  the process count that saved it."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from disttrain.storage import urls  # pylint: disable=g-import-not-at-top
  path = urls.join(urls.resolve(str(workdir)), 'checkpoints', str(step), 'state')
  checkpointer = ocp.PyTreeCheckpointer()
  metadata = checkpointer.metadata(path)  # orbax 0.11.20 returns the tree's metadata itself
  tree = getattr(metadata, 'item_metadata', metadata).tree
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
  leaves = jax.tree.leaves(restored['params'])
  assert leaves, f'{path} has no parameters'
  return leaves


# Execs its arguments with SIGINT's default action, which exec keeps (a fork with a preexec_fn
# would run Python in a child of the multithreaded test process).
_FOREGROUND = ('import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); '
               'os.execv(sys.argv[1], sys.argv[1:])')


def foreground(command: list[str]) -> list[str]:
  """`command` taking Ctrl-C as a terminal's foreground job does, also when the suite itself runs
  in the background (SIGINT ignored on entry, which a run then leaves ignored)."""
  return [sys.executable, '-c', _FOREGROUND, *command]


def sigkill_after_checkpoint(command: list[str], workdir, step: int, env: dict, cwd) -> None:
  """Starts a training command and SIGKILLs it once checkpoint `step` in `workdir` committed."""
  import pathlib  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 240
  try:
    while not (pathlib.Path(workdir) / 'checkpoints' / str(step) / 'data').is_dir():
      assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
      time.sleep(0.02)
    time.sleep(0.3)  # orbax renames the finished save into place last: it has committed
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()

"""The fast checkpoint tier: every local_checkpoint_every_steps, each process writes the shards
its devices hold to its own disk (or a ramdisk such as /dev/shm), plus a copy of its peer's.

Process p's peer copy is process p-1's shards (mod the process count), moved over the device
network by one reshard (storage/shards.py). A restart restores the newest step complete across
processes, each process from its own files or, where a host lost them (a replacement host, a
wiped disk), from the copy on process p+1, moved back by the inverse reshard; bit for bit, the
data position and callbacks included. Files reach the disk (fsync) before the rename that
commits their step, so a host's power loss leaves a step whole or absent.
Orbax's emergency manager was not used: it is experimental, needs a second replica of the state
along a slice axis to recover a lost host (a state split by fsdp over every process has none),
and writes the persistent tier from one slice only; this tier works for any NamedSharding layout.

Layout: ROOT/process_<p>/<step>/{own.npz, peer.npz, info.json}, committed by renaming <step>.tmp;
the newest KEEP steps are kept. DIR/local_tier.json (process 0) names the run, so a local tier
left by another run in the same place is never restored, and its newest step tells the restart
supervisor that an attempt made progress.
"""

import concurrent.futures
import errno
import hashlib
import json
import os
import shutil
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from disttrain.errors import CheckpointError
from disttrain.storage import progress, shards, urls

KEEP = 2  # the newest complete step and the one before it (a write torn by a kill is .tmp)
_SLOTS = 8  # newest steps each process reports when the processes agree on one


def default_root(workdir: str) -> str:
  digest = hashlib.sha1(urls.resolve(workdir).encode()).hexdigest()[:12]
  return os.path.join(tempfile.gettempdir(), 'disttrain-local', digest)


def _layout(arrays: list, paths: list[str]) -> list:
  return [[p, list(x.shape), str(x.dtype), str(x.sharding.spec),
           [[k, v] for k, v in x.sharding.mesh.shape.items()],
           [d.id for d in x.sharding.mesh.devices.flat]] for p, x in zip(paths, arrays)]


def _synced(path: Path, write) -> None:
  """Writes a file through `write(f)` and flushes it to the disk (before the step's rename)."""
  with open(path, 'wb') as f:
    write(f)
    f.flush()
    os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
  """Flushes a directory's entries; a file system that cannot (some network mounts) is skipped."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  except OSError as e:
    if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
      raise
  finally:
    os.close(fd)


def _broadcast_json(value: Any, source: bool) -> Any:
  """`value` from the process where `source` is True (exactly one) to every process."""
  raw = np.frombuffer(json.dumps(value).encode(), np.uint8) if source else np.zeros(0, np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int64(raw.size), is_source=source))
  raw = np.pad(raw, (0, size - raw.size))
  data = multihost_utils.broadcast_one_to_all(raw, is_source=source)
  return json.loads(bytes(np.asarray(data, np.uint8)).decode())


class LocalTier:
  """One process's fast tier: save (host copy now, file writes in the background), restore."""

  def __init__(self, root: str, workdir: str):
    self.n, self.p = jax.process_count(), jax.process_index()
    # As every local path (~/fast went to ./~/fast: a relaunch elsewhere missed it).
    self.root = Path(urls.resolve(root) if root else default_root(workdir))
    self.dir = self.root / f'process_{self.p}'
    self.marker = progress.local_marker(workdir)
    self.run = self._run_id()
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='local_tier')
    self._pending = None

  def _run_id(self) -> str:
    """The run's id from DIR/local_tier.json, made by process 0 at the run's first start."""
    run = None
    if self.p == 0:
      try:
        run = json.loads(self.marker.read_text())['run']
      except (OSError, ValueError, KeyError):
        run = uuid.uuid4().hex
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(json.dumps({'run': run, 'step': 0}))
    return _broadcast_json(run, self.p == 0) if self.n > 1 else run

  def save(self, step: int, state: Any, extra: dict) -> None:
    """Starts writing `step`: the arrays reach host memory (and the peer's) before it returns."""
    self.wait()
    paths_leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    arrays = [x for _, x in paths_leaves]
    own = shards.host_shards(arrays)
    peer = {}
    if self.n > 1:  # collectives: every process gets its predecessor's shards
      peer = shards.to_next(arrays, *shards.ring())
    info = {'step': step, 'run': self.run, 'processes': self.n, 'extra': extra,
            'layout': _layout(arrays, [jax.tree_util.keystr(p) for p, _ in paths_leaves])}
    self._pending = self._pool.submit(self._write, step, own, peer, info)

  def _write(self, step: int, own: dict, peer: dict, info: dict) -> None:
    tmp, final = self.dir / f'{step}.tmp', self.dir / str(step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _synced(tmp / 'own.npz', lambda f: np.savez(f, **own))
    if peer:
      _synced(tmp / 'peer.npz', lambda f: np.savez(f, **peer))
    _synced(tmp / 'info.json', lambda f: f.write(json.dumps(info).encode()))
    _sync_dir(tmp)  # the files' names
    shutil.rmtree(final, ignore_errors=True)  # a step of an abandoned trajectory
    os.rename(tmp, final)
    _sync_dir(self.dir)  # the rename too: after a power loss a step is whole or absent
    for old in self._steps()[:-KEEP]:
      shutil.rmtree(self.dir / str(old), ignore_errors=True)
    if self.p == 0:
      self.marker.write_text(json.dumps({'run': self.run, 'step': step}))

  def wait(self) -> None:
    """Blocks until the last save's files are written; a failed write is one line."""
    if self._pending is not None:
      pending, self._pending = self._pending, None
      try:
        pending.result()
      except OSError as e:
        raise CheckpointError(f'the fast checkpoint tier could not write to {self.dir}: {e}; '
                              'free space there or pass another --config.local_checkpoint_dir '
                              '(the persistent tier is unaffected)') from None

  def close(self) -> None:
    self.wait()
    self._pool.shutdown()

  def _steps(self) -> list[int]:
    try:
      return sorted(int(p.name) for p in self.dir.iterdir() if p.name.isdigit())
    except FileNotFoundError:
      return []

  def _opens(self, step: int, name: str) -> bool:
    """The step's file is a whole zip whose members' CRCs hold (a truncated or damaged one is
    not restored from: one flipped byte failed every relaunch). Reads the file once."""
    try:
      with zipfile.ZipFile(self.dir / str(step) / name) as z:
        return z.testzip() is None
    except Exception:  # pylint: disable=broad-except  (a damaged header: EOFError, ValueError, ...)
      return False

  def _info(self, step: int) -> dict | None:
    try:
      return json.loads((self.dir / str(step) / 'info.json').read_text())
    except (OSError, ValueError):
      return None

  def newest_complete(self, abstract: Any) -> tuple[int, list[int]] | None:
    """(the newest step every process can restore, the processes that need their peer's copy);
    None if there is none. Called by every process: the choice is agreed."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    layout = _layout([x for _, x in leaves], [jax.tree_util.keystr(p) for p, _ in leaves])
    own, peer, other = [], [], []
    for step in reversed(self._steps()):
      info = self._info(step)
      if info and info['run'] == self.run:
        fits = info['layout'] == layout
        if fits and not self._opens(step, 'own.npz'):
          print(f'fast tier: step {step} in {self.dir} is damaged (own.npz); not restored from',
                flush=True)
          continue
        (own if fits else other).append(step)
        if fits and (self.dir / str(step) / 'peer.npz').exists() and self._opens(step,
                                                                                  'peer.npz'):
          peer.append(step)
    if other and self.p == 0:
      print(f'fast tier: step {other[0]} in {self.dir} was saved with another layout (mesh, '
            'shapes or shardings); it is not used, the workdir\'s checkpoints are', flush=True)
    table = np.full((2, _SLOTS), -1, np.int64)
    table[0, :len(own[:_SLOTS])], table[1, :len(peer[:_SLOTS])] = own[:_SLOTS], peer[:_SLOTS]
    tables = np.asarray(multihost_utils.process_allgather(table)) if self.n > 1 else table[None]
    for step in sorted({int(s) for s in tables[:, 0].flat if s >= 0}, reverse=True):
      has = [step in tables[p, 0] for p in range(self.n)]
      missing = [p for p in range(self.n) if not has[p]]
      if all(has[(p + 1) % self.n] and step in tables[(p + 1) % self.n, 1] for p in missing):
        return step, missing
    return None

  def restore(self, step: int, missing: list[int], abstract: Any) -> tuple[Any, dict]:
    """(state, the extra dict saved with it) of an agreed step; every process calls it."""
    leaves, treedef = jax.tree.flatten(abstract)
    mine = self.dir / str(step)
    if self.p not in missing:
      own = np.load(mine / 'own.npz')
      arrays = [shards.assemble(i, x, own) for i, x in enumerate(leaves)]
    if missing:  # process p's shards come back from p+1's copy
      holds = (self.p - 1) % self.n in missing
      moved = shards.from_next(leaves, np.load(mine / 'peer.npz') if holds else None,
                               *shards.ring(), self.p)
      if self.p in missing:
        arrays = moved
    source = self.p == min(set(range(self.n)) - set(missing))
    extra = self._info(step)['extra'] if source else None
    if self.n > 1:
      extra = _broadcast_json(extra, source)
    return jax.tree.unflatten(treedef, arrays), extra

  def forget_after(self, step: int) -> None:
    """Drops steps newer than the one the run resumed from: another trajectory's."""
    for newer in self._steps():
      if newer > step:
        shutil.rmtree(self.dir / str(newer), ignore_errors=True)

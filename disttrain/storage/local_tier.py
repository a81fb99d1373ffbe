"""The fast checkpoint tier: every local_checkpoint_every_steps, each process writes the shards
its devices hold to its own disk (or a ramdisk such as /dev/shm), plus a copy of its peer's.

Process p's peer copy is process p-1's shards (mod the process count), moved over the device
network by one reshard: each device's shard is one block of an array over a ring of all
devices, resharded onto that ring rotated by one process (every block moves, replicas too).
A restart restores the newest step complete across processes, each process from its own files
or, where a host lost them (a replacement host, a wiped disk), from the copy on process p+1,
moved back by the inverse reshard; bit for bit, the data position and callbacks included.
Orbax's emergency manager was not used: it is experimental, needs a second replica of the state
along a slice axis to recover a lost host (a state split by fsdp over every process has none),
and writes the persistent tier from one slice only; this tier works for any NamedSharding layout.

Layout: ROOT/process_<p>/<step>/{own.npz, peer.npz, info.json}, committed by renaming <step>.tmp;
the newest KEEP steps are kept. DIR/local_tier.json (process 0) names the run, so a local tier
left by another run in the same place is never restored, and its newest step tells the restart
supervisor that an attempt made progress.
"""

import concurrent.futures
import hashlib
import json
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from disttrain.errors import CheckpointError
from disttrain.storage import urls

KEEP = 2  # the newest complete step and the one before it (a write torn by a kill is .tmp)
MARKER = 'local_tier.json'  # in the workdir: {'run': id, 'step': process 0's newest local step}
_SLOTS = 8  # newest steps each process reports when the processes agree on one
CHUNK_BYTES = 2**28  # per device: the peer copy moves the state in groups of leaves this large


def default_root(workdir: str) -> str:
  digest = hashlib.sha1(urls.resolve(workdir).encode()).hexdigest()[:12]
  return os.path.join(tempfile.gettempdir(), 'disttrain-local', digest)


def newest_step(workdir: str) -> int:
  """Process 0's newest fast-tier step as DIR/local_tier.json records it (0 if none)."""
  try:
    return int(json.loads(urls.path(urls.join(urls.resolve(workdir), MARKER)).read_text())['step'])
  except Exception:  # pylint: disable=broad-except  # no tier, or storage down: no progress known
    return 0


def _key(index: tuple, shape: tuple) -> str:
  """A shard's place in its array, e.g. '0:4,0:64' (the same on every process)."""
  return ','.join('%d:%d' % s.indices(n)[:2] for s, n in zip(index, shape))


def _host_shards(arrays: list) -> dict[str, np.ndarray]:
  """Each distinct shard this process holds, copied to host memory (replicas once)."""
  shards = {}
  for i, x in enumerate(arrays):
    for shard in x.addressable_shards:
      name = f'{i}|{_key(shard.index, x.shape)}'
      if name not in shards:
        shard.data.copy_to_host_async()
        shards[name] = shard.data
  return {name: np.asarray(data) for name, data in shards.items()}


def _layout(arrays: list, paths: list[str]) -> list:
  return [[p, list(x.shape), str(x.dtype), str(x.sharding.spec),
           [[k, v] for k, v in x.sharding.mesh.shape.items()],
           [d.id for d in x.sharding.mesh.devices.flat]] for p, x in zip(paths, arrays)]


def _ring() -> tuple[Mesh, Mesh]:
  """Every device on one axis, process by process; and that axis with each device replaced by
  the next process's device at the same place (the last process's by the first's)."""
  by_process = {}
  for d in sorted(jax.devices(), key=lambda d: d.id):
    by_process.setdefault(d.process_index, []).append(d)
  order = sorted(by_process)
  devices = [d for p in order for d in by_process[p]]
  following = [by_process[order[(j + 1) % len(order)]][i]
               for j, p in enumerate(order) for i in range(len(by_process[p]))]
  return Mesh(np.array(devices), ('ring',)), Mesh(np.array(following), ('ring',))


def _unstack(data: np.ndarray, dtype) -> np.ndarray:
  return data if data.dtype == dtype else data.view(dtype)  # npz keeps bfloat16 & co as bytes


def _groups(leaves: list) -> list[list[int]]:
  """Leaf indices in groups of at most CHUNK_BYTES per device (one leaf at least): the peer
  copy moves a group at a time, so its extra copies need little device memory."""
  groups, size = [[]], 0
  for i, x in enumerate(leaves):
    if groups[-1] and size >= CHUNK_BYTES:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
  return groups


def _to_next(arrays: list, ring: Mesh, following: Mesh) -> dict[str, np.ndarray]:
  """The shards of the previous process, moved here: each device's shard becomes one block of a
  ring-sharded array, and the reshard onto the following devices moves every block, replicas
  too (a reshard of the state itself would leave a replica where it is)."""
  shards = {}
  for group in _groups(arrays):
    blocks = [jax.make_array_from_single_device_arrays(
        (ring.size, *arrays[i].sharding.shard_shape(arrays[i].shape)),
        NamedSharding(ring, P('ring')), [s.data[None] for s in arrays[i].addressable_shards])
              for i in group]
    moved = jax.device_put(blocks, [NamedSharding(following, P('ring'))] * len(blocks))
    on_device = {}
    for i, got in zip(group, moved):
      x = arrays[i]
      where = x.sharding.devices_indices_map(x.shape)
      for shard in got.addressable_shards:  # block k: the shard of ring device k
        name = f'{i}|{_key(where[ring.devices[shard.index[0].start]], x.shape)}'
        if name not in on_device:
          shard.data.copy_to_host_async()
          on_device[name] = shard.data
    shards.update({name: np.asarray(data)[0] for name, data in on_device.items()})
  return shards


def _from_next(leaves: list, peer, ring: Mesh, following: Mesh, me: int) -> list:
  """The inverse of _to_next, for processes whose own files are gone: every process passes the
  copies it holds (`peer`; None: none that are needed), the blocks move back, and each device
  receives its shard."""
  out = []
  for group in _groups(leaves):
    blocks = []
    for i in group:
      x = leaves[i]
      where, shape = x.sharding.devices_indices_map(x.shape), x.sharding.shard_shape(x.shape)
      pieces = []
      for k, device in enumerate(following.devices):
        if device.process_index == me:
          host = (np.zeros(shape, x.dtype) if peer is None else
                  _unstack(peer[f'{i}|{_key(where[ring.devices[k]], x.shape)}'], x.dtype))
          pieces.append(jax.device_put(host[None], device))
      blocks.append(jax.make_array_from_single_device_arrays(
          (ring.size, *shape), NamedSharding(following, P('ring')), pieces))
    back = jax.device_put(blocks, [NamedSharding(ring, P('ring'))] * len(blocks))
    out += [jax.make_array_from_single_device_arrays(
        leaves[i].shape, leaves[i].sharding, [s.data[0] for s in b.addressable_shards])
            for i, b in zip(group, back)]
  return out


def _assemble(i: int, abstract: Any, shards) -> jax.Array:
  """Leaf i as a global array from this process's own shards."""
  sharding = abstract.sharding
  pieces = [jax.device_put(_unstack(shards[f'{i}|{_key(index, abstract.shape)}'], abstract.dtype),
                           device)
            for device, index in sharding.addressable_devices_indices_map(abstract.shape).items()]
  return jax.make_array_from_single_device_arrays(abstract.shape, sharding, pieces)


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
    self.root = Path(root or default_root(workdir))
    self.dir = self.root / f'process_{self.p}'
    self.marker = urls.path(urls.join(urls.resolve(workdir), MARKER))
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
    own = _host_shards(arrays)
    peer = {}
    if self.n > 1:  # collectives: every process gets its predecessor's shards
      peer = _to_next(arrays, *_ring())
    info = {'step': step, 'run': self.run, 'processes': self.n, 'extra': extra,
            'layout': _layout(arrays, [jax.tree_util.keystr(p) for p, _ in paths_leaves])}
    self._pending = self._pool.submit(self._write, step, own, peer, info)

  def _write(self, step: int, own: dict, peer: dict, info: dict) -> None:
    tmp, final = self.dir / f'{step}.tmp', self.dir / str(step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.savez(tmp / 'own.npz', **own)
    if peer:
      np.savez(tmp / 'peer.npz', **peer)
    (tmp / 'info.json').write_text(json.dumps(info))
    shutil.rmtree(final, ignore_errors=True)  # a step of an abandoned trajectory
    os.rename(tmp, final)
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
        (own if info['layout'] == layout else other).append(step)
        if info['layout'] == layout and (self.dir / str(step) / 'peer.npz').exists():
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
      arrays = [_assemble(i, x, own) for i, x in enumerate(leaves)]
    if missing:  # process p's shards come back from p+1's copy
      holds = (self.p - 1) % self.n in missing
      moved = _from_next(leaves, np.load(mine / 'peer.npz') if holds else None, *_ring(), self.p)
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

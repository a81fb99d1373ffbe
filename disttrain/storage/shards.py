"""A state's shards on the host, and the peer copy: each process's shards moved to the next one.

  host_shards(arrays) -> {name(leaf, index, shape): np.ndarray}   the distinct shards held here
  to_next(arrays, *ring()) -> the same for the previous process's shards (a collective)
  from_next(abstract, peer, *ring(), me) -> the arrays, shards of lost processes moved back
  assemble(i, abstract, shards) -> leaf i from this process's own shards

The peer copy: each device's shard becomes one block of an array over a ring of all devices,
resharded onto that ring rotated by one process, so every block moves, replicas too (a reshard
of the state itself would leave a replica where it is, which is wrong for the way back). The
fast checkpoint tier (storage/local_tier.py) writes both and restores from either.
"""

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

CHUNK_BYTES = 2**28  # per device: the peer copy moves the state in groups of leaves this large


def name(leaf: int, index: tuple, shape: tuple) -> str:
  """A shard's name: its leaf and its place in the array, e.g. '3|0:4,0:64' (the same on every
  process)."""
  return f'{leaf}|' + ','.join('%d:%d' % s.indices(n)[:2] for s, n in zip(index, shape))


def _fetch(named) -> dict[str, np.ndarray]:
  """(name, device array) pairs to host memory, each name once, the copies started together."""
  on_device = {}
  for label, data in named:
    if label not in on_device:
      data.copy_to_host_async()
      on_device[label] = data
  return {label: np.asarray(data) for label, data in on_device.items()}


def host_shards(arrays: list) -> dict[str, np.ndarray]:
  """Each distinct shard this process holds, copied to host memory (replicas once)."""
  return _fetch((name(i, shard.index, x.shape), shard.data)
                for i, x in enumerate(arrays) for shard in x.addressable_shards)


def ring() -> tuple[Mesh, Mesh]:
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
  out, size = [[]], 0
  for i, x in enumerate(leaves):
    if out[-1] and size >= CHUNK_BYTES:
      out.append([])
      size = 0
    out[-1].append(i)
    size += math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
  return out


def to_next(arrays: list, ring: Mesh, following: Mesh) -> dict[str, np.ndarray]:
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
    where = {i: arrays[i].sharding.devices_indices_map(arrays[i].shape) for i in group}
    # Block k of a moved array is the shard of ring device k.
    shards.update({label: data[0] for label, data in _fetch(
        (name(i, where[i][ring.devices[shard.index[0].start]], arrays[i].shape), shard.data)
        for i, got in zip(group, moved) for shard in got.addressable_shards).items()})
  return shards


def from_next(leaves: list, peer, ring: Mesh, following: Mesh, me: int) -> list:
  """The inverse of to_next, for processes whose own files are gone: every process passes the
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
                  _unstack(peer[name(i, where[ring.devices[k]], x.shape)], x.dtype))
          pieces.append(jax.device_put(host[None], device))
      blocks.append(jax.make_array_from_single_device_arrays(
          (ring.size, *shape), NamedSharding(following, P('ring')), pieces))
    back = jax.device_put(blocks, [NamedSharding(ring, P('ring'))] * len(blocks))
    out += [jax.make_array_from_single_device_arrays(
        leaves[i].shape, leaves[i].sharding, [s.data[0] for s in b.addressable_shards])
            for i, b in zip(group, back)]
  return out


def assemble(i: int, abstract: Any, shards) -> jax.Array:
  """Leaf i as a global array from this process's own shards."""
  sharding = abstract.sharding
  pieces = [jax.device_put(_unstack(shards[name(i, index, abstract.shape)], abstract.dtype),
                           device)
            for device, index in sharding.addressable_devices_indices_map(abstract.shape).items()]
  return jax.make_array_from_single_device_arrays(abstract.shape, sharding, pieces)

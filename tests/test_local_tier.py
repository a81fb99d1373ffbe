"""The fast checkpoint tier in one process (storage/local_tier.py) on 8 devices, fsdp x data:
a resume from it equals the uninterrupted run bit for bit, bfloat16 optimizer state included;
it is never restored into another layout or another run. The peer copy between processes and
the restart supervisor: tests/test_multiprocess.py."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain import config as config_lib
from disttrain.operating import events
from disttrain.storage import local_tier, shards
from tests import helpers
from tests.conftest import ROOT

BASE = {'model.hidden': 64, 'global_batch_size': 32, 'log_every_steps': 1, 'eval_every_steps': 0,
        'mesh.data': 4, 'mesh.fsdp': 2, 'sharding': 'fsdp', 'fsdp_min_size': 1024,
        'optimizer': 'adam', 'mu_dtype': 'bfloat16', 'checkpoint_every_steps': 100}


def _config(**overrides) -> disttrain.Config:
  return config_lib.from_config_dict(helpers.override(
      helpers.config_file(ROOT / 'launch/configs/mnist_mlp.py'), {**BASE, **overrides}))


def _leaves(result) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves((result.state.params, result.state.opt_state))]


def test_resume_from_the_fast_tier_is_exact_and_stays_in_its_run_and_layout(tmp_path, capfd,
                                                                           monkeypatch):
  want = _leaves(disttrain.train(_config(num_train_steps=10), str(tmp_path / 'ref')))
  work, local = tmp_path / 'run', tmp_path / 'local'
  fast = {'local_checkpoint_every_steps': 5, 'local_checkpoint_dir': str(local)}
  disttrain.train(_config(num_train_steps=7, **fast), str(work))
  assert sorted(p.name for p in (local / 'process_0').iterdir()) == ['5']
  shutil.rmtree(work / 'checkpoints' / '7')  # the persistent tier lost its newest save
  capfd.readouterr()
  got = disttrain.train(_config(num_train_steps=10, **fast), str(work))
  assert f'resumed from step 5: the fast tier in {local}' in capfd.readouterr().out
  for a, b in zip(_leaves(got), want, strict=True):
    np.testing.assert_array_equal(a, b)
  assert [(e['step'], e['tier']) for e in events.read(str(work)) if e['event'] == 'restore'] == [
      (5, 'local')]
  # Another layout: the fast tier's files hold other shards; the workdir's checkpoint is used.
  disttrain.train(_config(num_train_steps=17, **fast), str(work))  # fast save at 15
  shutil.rmtree(work / 'checkpoints' / '17')
  capfd.readouterr()
  again = disttrain.train(_config(num_train_steps=18, **fast, **{'mesh.data': 8, 'mesh.fsdp': 1,
                                                                   'sharding': 'replicate'}),
                          str(work))
  out = capfd.readouterr().out
  assert 'fast tier: step 15' in out and 'was saved with another layout' in out, out
  assert 'resumed from step 10: ' in out and again.step == 18
  # A new run in a reused workdir never takes the old run's fast tier.
  shutil.rmtree(work)
  capfd.readouterr()
  fresh = disttrain.train(_config(num_train_steps=2, **fast), str(work))
  assert 'resumed' not in capfd.readouterr().out and fresh.step == 2
  # A damaged file of the newest fast step (one flipped byte in its arrays: the zip's directory
  # opened, its CRC failed the restore on every relaunch): that step is passed over, the older
  # persistent one restores. local_checkpoint_dir='~/local' (a shell leaves it after '=') is
  # HOME's, not ./~/local.
  shutil.rmtree(work)
  monkeypatch.setenv('HOME', str(tmp_path))
  monkeypatch.chdir(work.parent)
  fast = {**fast, 'local_checkpoint_dir': '~/local'}
  disttrain.train(_config(num_train_steps=7, checkpoint_every_steps=4, **fast), str(work))
  shutil.rmtree(work / 'checkpoints' / '7')
  own = local / 'process_0' / '5' / 'own.npz'
  damaged = bytearray(own.read_bytes())
  damaged[len(damaged) // 2] ^= 0xFF
  own.write_bytes(bytes(damaged))
  capfd.readouterr()
  disttrain.train(_config(num_train_steps=8, checkpoint_every_steps=4, **fast), str(work))
  out = capfd.readouterr().out
  assert 'fast tier: step 5 in' in out and 'is damaged (own.npz)' in out, out
  assert 'resumed from step 4: ' in out, out


@pytest.mark.parametrize('overrides,message', [
    ({'local_checkpoint_every_steps': 5, 'step_mode': 'pmap'},
     'local_checkpoint_every_steps needs a mesh-sharded state, not step_mode=pmap'),
    ({'local_checkpoint_every_steps': 5, 'local_checkpoint_dir': 'gs://b/fast'},
     "local_checkpoint_dir='gs://b/fast' is a URL"),
    ({'local_checkpoint_every_steps': -1}, 'local_checkpoint_every_steps=-1'),
])
def test_bad_fast_tier_settings_are_one_line(overrides, message):
  with pytest.raises(disttrain.ConfigError, match=message.replace('(', r'\(')):
    _config(**{'mesh.data': 8, 'mesh.fsdp': 1, 'sharding': 'replicate', **overrides})


def test_peer_copy_moves_every_block_in_groups(monkeypatch):
  """The ring moves in one process (its following devices are its own): in groups of one leaf
  or all at once, every shard comes out under its key, and moved back it rebuilds the arrays;
  with fsdp x data, replicated and split leaves, bfloat16 among them."""
  mesh = jax.make_mesh((4, 2), ('data', 'fsdp'))
  specs = [jax.sharding.PartitionSpec('fsdp', None), jax.sharding.PartitionSpec(),
           jax.sharding.PartitionSpec(None, ('data', 'fsdp'))]
  arrays = [jax.device_put(np.arange(64 * 8, dtype=dtype).reshape(64, 8) * (k + 1),
                           jax.sharding.NamedSharding(mesh, spec))
            for k, (spec, dtype) in enumerate(zip(specs, [np.float32, jnp.bfloat16, np.int32]))]
  own = shards.host_shards(arrays)
  whole = shards.to_next(arrays, *shards.ring())
  monkeypatch.setattr(shards, 'CHUNK_BYTES', 1)
  grouped = shards.to_next(arrays, *shards.ring())
  assert sorted(own) == sorted(whole) == sorted(grouped)
  for name, data in own.items():
    np.testing.assert_array_equal(whole[name], data)
    np.testing.assert_array_equal(grouped[name], data)
  abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in arrays]
  back = shards.from_next(abstract, grouped, *shards.ring(), 0)
  for x, y in zip(arrays, back, strict=True):
    assert y.sharding == x.sharding
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_a_fast_save_reaches_the_disk_before_the_rename_that_commits_it(tmp_path, monkeypatch):
  """Each file of a step is fsynced once written in full, then <step>.tmp's entries, before the
  rename that commits the step, and the process directory after it: a host's power loss leaves
  the step whole or absent, never renamed with torn files."""
  calls, fsync, rename = [], os.fsync, os.rename

  def synced(fd):
    calls.append(('fsync', os.readlink(f'/proc/self/fd/{fd}'), os.fstat(fd).st_size))
    return fsync(fd)
  monkeypatch.setattr(os, 'fsync', synced)
  monkeypatch.setattr(os, 'rename', lambda a, b: (
      calls.append(('rename', os.path.realpath(a))), rename(a, b))[1])
  tier = local_tier.LocalTier(str(tmp_path / 'local'), str(tmp_path / 'run'))
  split = jax.sharding.NamedSharding(jax.make_mesh((8,), ('fsdp',)),
                                    jax.sharding.PartitionSpec('fsdp'))
  tier.save(5, {'w': jax.device_put(np.ones((8, 4), np.float32), split)}, {'data': 1})
  tier.close()
  where = os.path.realpath(tmp_path / 'local' / 'process_0')
  assert [c[:2] for c in calls] == [
      ('fsync', f'{where}/5.tmp/own.npz'), ('fsync', f'{where}/5.tmp/info.json'),
      ('fsync', f'{where}/5.tmp'), ('rename', f'{where}/5.tmp'), ('fsync', where)], calls
  for name, (_, _, size) in zip(['own.npz', 'info.json'], calls):  # synced once complete
    assert size == os.path.getsize(f'{where}/5/{name}') > 0, calls

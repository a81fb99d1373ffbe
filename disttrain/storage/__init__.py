"""Where a run's files live: storage URLs (local, gs://, s3://) and orbax checkpoints.

  urls        the one place that knows storage URLs: epath, orbax's s3 kvstore, commit markers,
              the emulators' settings, process 0's mirror of small files
  checkpoint  the orbax manager: async saves, keep-N / best, resharding restore, corrupt fallback
  checkpoint_reads  a run's checkpoints read outside its loop: saved config, warm start, subtrees
  local_tier  the fast tier: each process's shards and a peer's copy on its own disk
  shards      moving a sharded state's pieces between processes (the peer copy's reshard)
  progress    how far a run has come, read without jax (the restart supervisor)
The URL functions are also this package's names (`disttrain.storage.join`), as before.
"""

from disttrain import moved

_EXPORTS = {name: 'urls' for name in (
    'SCHEMES', 'Mirror', 'append_line', 'check_writable', 'committed_steps', 'is_bucket', 'join',
    'path', 'read_text', 'resolve', 's3_endpoint', 'scheme', 'write_text')}
__all__ = sorted(_EXPORTS)
__getattr__ = moved.names(__name__, _EXPORTS)

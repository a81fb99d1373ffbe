"""How far a run has come, as its workdir says, read without jax: the restart supervisor is a
long-lived process on every host, and importing jax would cost it 1.2 s and 140 MiB.

  committed_step  the newest complete checkpoint of the persistent tier (checkpoints/<step>)
  local_step      the fast tier's newest step (storage/local_tier.py), from DIR/local_tier.json
Either is 0 when there is none or the storage cannot be read: progress unknown is not progress.
"""

import json

from disttrain.storage import urls

LOCAL_MARKER = 'local_tier.json'  # {'run': id, 'step': process 0's newest fast-tier step}


def committed_step(workdir: str) -> int:
  """The newest complete checkpoint of the run, in a local directory or a bucket."""
  try:
    return max(urls.committed_steps(urls.join(urls.resolve(workdir), 'checkpoints')),
               default=0)
  except Exception:  # pylint: disable=broad-except  # storage down: progress unknown, not made
    return 0


def local_marker(workdir: str):
  """DIR/local_tier.json as a path (process 0 writes it; storage/local_tier.py)."""
  return urls.path(urls.join(urls.resolve(workdir), LOCAL_MARKER))


def local_step(workdir: str) -> int:
  """Process 0's newest fast-tier step as DIR/local_tier.json records it."""
  try:
    return int(json.loads(local_marker(workdir).read_text())['step'])
  except Exception:  # pylint: disable=broad-except  # no tier, or storage down
    return 0

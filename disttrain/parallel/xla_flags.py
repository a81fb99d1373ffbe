"""XLA flags disttrain adds on NVIDIA GPUs, under the user's own XLA_FLAGS.

XLA reads XLA_FLAGS once, when the first backend starts (not at `import jax`), so the launcher
calls `apply` before anything asks jax for devices. A flag the user's XLA_FLAGS set, to any value,
is left alone. Every name and value below parses in jaxlib 0.12.0.1 (its libjax_common.so holds
the names; an unknown flag or value aborts the process, so re-check them when jax moves).
Nothing here imports jax.
"""

import importlib.metadata
import os
import re

GPU_DEFAULTS = (
    # Schedules collectives (fsdp all-gathers, gradient reduce-scatters) to overlap compute.
    ('xla_gpu_enable_latency_hiding_scheduler', 'true'),
    # Unrolls scanned loops (layers, micro-batches, steps_per_dispatch) by two, so one
    # iteration's collectives overlap the next one's compute.
    ('xla_gpu_enable_while_loop_double_buffering', 'true'),
    # XLA already captures fusions and library calls as CUDA graphs; add loops and conditionals,
    # so a scanned loop launches as one graph instead of kernel by kernel.
    ('xla_gpu_enable_command_buffer', '+WHILE,+CONDITIONAL'),
)
CUDA_PLUGINS = ('jax-cuda12-plugin', 'jax-cuda13-plugin')
_added: list[str] = []  # what `apply` added in this process: run.json's xla_flags


def _installed(distribution: str) -> bool:
  try:
    importlib.metadata.version(distribution)
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


def on_gpu(jax_platforms: str | None, installed=_installed) -> bool:
  """Whether JAX will start on NVIDIA GPUs, decided before it starts (nothing is imported)."""
  # JAX finds CUDA devices only through a CUDA plugin, and a set JAX_PLATFORMS must name them.
  if not any(installed(name) for name in CUDA_PLUGINS):
    return False
  names = [p.strip() for p in (jax_platforms or '').split(',') if p.strip()]
  return not names or bool({'cuda', 'gpu'} & set(names))


def sets(xla_flags: str, name: str) -> bool:
  """Whether an XLA_FLAGS string sets flag `name` (--name, --name=value or --noname)."""
  return re.search(rf'(?:^|\s)--(?:no)?{re.escape(name)}(?:[=\s]|$)', xla_flags) is not None


def merge(xla_flags: str, gpu: bool, enabled: bool = True) -> tuple[str, list[str]]:
  """(the XLA_FLAGS to use, the defaults added): on a GPU, each default the user's flags do not
  set, after theirs; nothing on other platforms or when not `enabled`."""
  if not (gpu and enabled):
    return xla_flags, []
  added = [f'--{name}={value}' for name, value in GPU_DEFAULTS if not sets(xla_flags, name)]
  return ' '.join([xla_flags.strip(), *added]).strip(), added


def apply(gpu: bool, enabled: bool = True) -> list[str]:
  """Merges the defaults into os.environ['XLA_FLAGS'] (before the backend starts); returns and
  remembers what was added."""
  flags, added = merge(os.environ.get('XLA_FLAGS', ''), gpu, enabled)
  if added:
    os.environ['XLA_FLAGS'] = flags
  _added[:] = added
  return added


def applied() -> dict:
  """run.json's `xla_flags`: the XLA_FLAGS this process runs with, and which of them disttrain
  added."""
  return {'XLA_FLAGS': os.environ.get('XLA_FLAGS', ''), 'added_by_disttrain': list(_added)}

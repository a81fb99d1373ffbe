"""Gemma 2 and 3's own config.json parts: which layers attend to a window (`layer_types`), the
windowed layers' rotary base, the query scale and the logit caps: read into model fields and
checked against a run's; the export writes its layer_types (hf/exported_config.py).
"""

import numpy as np

from disttrain.config import ModelConfig
from disttrain.errors import CheckpointError
from disttrain.hf import families


def pattern(config: dict, family: str) -> int:
  """Every Nth layer global: from layer_types (a list of sliding_attention / full_attention),
  or sliding_window_pattern, or the family's published pattern (which layer_types of fewer layers
  than it, all local, keep)."""
  types = config.get('layer_types')
  published = int(config.get('sliding_window_pattern') or (2 if family == 'gemma2' else 6))
  if not types:
    return published
  for every in (published, *range(1, len(types) + 2)):
    if all((t == 'full_attention') == ((i + 1) % every == 0) for i, t in enumerate(types)):
      return every
  raise CheckpointError(f'config.json layer_types {types} is not every Nth layer global, the '
                        'pattern disttrain builds; use a config of that form')


def layer_types(every: int, window: int, num_layers: int) -> list[str]:
  """config.json's layer_types of our Gemma layers (pattern 0 with a window: all local)."""
  return ['sliding_attention' if window and (not every or (i + 1) % every)
          else 'full_attention' for i in range(num_layers)]


def local_as_global(config: dict) -> bool:
  """Gemma 3's windowed layers rotate as the global ones with their scaling (local_rope_theta 0;
  unscaled, the local base is the global one either way)."""
  params = config.get('rope_parameters') or {}
  local = params.get('sliding_attention')
  return bool(local) and local == params.get('full_attention') and local.get(
      'rope_type', 'default') != 'default'


def fields(config: dict, family: str) -> dict:
  """model.* fields of Gemma's parts: the layer pattern, local rotary base, scale and caps."""
  params = config.get('rope_parameters') or {}
  local = 0.0 if local_as_global(config) else (params.get('sliding_attention') or {}).get(
      'rope_theta') or config.get('rope_local_base_freq') or (
          10_000.0 if family == 'gemma3' else 0.0)
  cap = lambda key: float(families.resolved(config, family, key) or 0.0)
  return {'sliding_window_pattern': pattern(config, family) if families.window(
              config, family) else 0,
          'local_rope_theta': float(local) if family == 'gemma3' else 0.0,
          'query_pre_attn_scalar': float(config.get('query_pre_attn_scalar') or 256),
          # transformers' Gemma 3 attention applies no cap whatever the key says (5.x).
          'attn_softcap': cap('attn_logit_softcapping') if family == 'gemma2' else 0.0,
          'final_softcap': cap('final_logit_softcapping')}


def check(directory: str, family: str, config: dict, cfg: ModelConfig) -> None:
  """The run's Gemma fields against config.json's; a difference is one line naming both."""
  theirs = fields(config, family)
  every, window, n = theirs.pop('sliding_window_pattern'), cfg.sliding_window, cfg.num_layers
  if layer_types(every, window, n) != layer_types(cfg.sliding_window_pattern, window, n):
    raise CheckpointError(f'{directory}: config.json layer_types make every {every}th layer '
                          f'global but model.sliding_window_pattern='
                          f'{cfg.sliding_window_pattern}; set '
                          f'--config.model.sliding_window_pattern={every}')
  local = theirs.pop('local_rope_theta')
  for key, value in theirs.items():
    if not np.isclose(getattr(cfg, key), value, rtol=1e-6):
      raise families.mismatch(directory, key, value, f'model.{key}', getattr(cfg, key))
  # Unscaled, local_rope_theta 0 rotates the windowed layers on rope_theta: the same model;
  # pattern 0 has no local layer of ours (every layer on the global base).
  base = lambda v: v or cfg.rope_theta if not cfg.rope_scaling.kind else v
  if cfg.sliding_window and cfg.sliding_window_pattern and not np.isclose(
      base(cfg.local_rope_theta), base(local), rtol=1e-6):
    raise families.mismatch(directory, 'local_rope_theta', local, 'model.local_rope_theta',
                            cfg.local_rope_theta)

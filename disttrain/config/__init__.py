"""Typed, frozen run config; validated when built, unknown fields rejected, one-line errors.

The dataclasses are the single schema, one module per part of a run; the generated reference
(disttrain/config_reference.py) reads their field comments:

  run            Config: the top-level fields (optimizer, schedule, cadence, guards), checks
                 across groups
  operating      early_stop.*, profile.*, tracking.*
  layout         mesh.*, dcn_mesh.*, the sharding and step styles, tensor-parallel rules
  data           data.* and its per-source groups
  model          model.*, model.rope_scaling.*, precision.*
  post_training  lora.*, dpo.*, grpo.*
  build          defaults() (a locked ConfigDict for config files and --config.<field>
                 overrides) and from_config_dict() (back to a validated Config)
  checks         the one-line field checks every group shares
  conditional    fields that apply only with another set: refused alone, dropped from saved runs

Every name is importable from `disttrain.config`, as when the schema was one module. Importing
it loads no jax: config files and bad command lines are answered without it.
"""

from disttrain.config.build import DEPRECATED, defaults, from_config_dict
from disttrain.config.data import (FILE_SOURCES, MIXABLE, PACKING, TOKEN_DTYPES, DataConfig,
                                   SftConfig, SyntheticConfig, TextConfig, TokensConfig)
from disttrain.config.layout import (LAYER_AXES, MESH_AXES, SHARDINGS, STEP_MODES, DcnMeshConfig,
                                     MeshConfig)
from disttrain.config.model import ATTENTION, REMAT, ModelConfig, PrecisionConfig, RopeScalingConfig
from disttrain.config.post_training import LORA_TARGETS, DpoConfig, GrpoConfig, LoraConfig
from disttrain.config.operating import EarlyStopConfig, ProfileConfig, TrackingConfig
from disttrain.config.run import LR_SCHEDULES, OPTIMIZERS, Config
from disttrain.errors import ConfigError

__all__ = ['ATTENTION', 'Config', 'ConfigError', 'DEPRECATED', 'DataConfig', 'DcnMeshConfig',
           'DpoConfig', 'EarlyStopConfig', 'FILE_SOURCES', 'GrpoConfig', 'LAYER_AXES',
           'LORA_TARGETS', 'LR_SCHEDULES', 'LoraConfig', 'MESH_AXES', 'MIXABLE', 'MeshConfig',
           'ModelConfig', 'OPTIMIZERS', 'PACKING', 'PrecisionConfig', 'ProfileConfig', 'REMAT',
           'RopeScalingConfig', 'SHARDINGS', 'STEP_MODES', 'SftConfig', 'SyntheticConfig',
           'TOKEN_DTYPES', 'TextConfig', 'TokensConfig', 'TrackingConfig', 'defaults',
           'from_config_dict']

"""lora.*, dpo.* and grpo.*: adapters, preference optimization and reinforcement learning."""

import dataclasses
import re

from disttrain.config.checks import one_of, positive
from disttrain.errors import ConfigError

LORA_TARGETS = r'(attention/(query|key|value|qkv|out)|mlp/(gate|up|down|mlp_in|mlp_out))/kernel$'


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (disttrain/models/lora.py): only they train, the base weights are frozen
  and stored once; language models."""
  rank: int = 0  # adapter rank r; 0 = off (every weight trains)
  alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  dropout: float = 0.0  # dropout on the adapters' input while training (PEFT's lora_dropout)
  # regex searched in each projection's parameter path ('blocks/attention/query/kernel'); the
  # default: every attention and MLP projection
  targets: str = LORA_TARGETS
  base_dtype: str = 'float32'  # the frozen base weights' storage: float32 or bfloat16

  def __post_init__(self):
    positive('lora.rank', self.rank, allow_zero=True)
    if self.alpha <= 0:
      raise ConfigError(f'lora.alpha={self.alpha} must be > 0; PEFT uses e.g. 16 or 2 x rank')
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f'lora.dropout={self.dropout} must be in [0, 1)')
    one_of('lora.base_dtype', self.base_dtype, ('float32', 'bfloat16'))
    try:
      re.compile(self.targets)
    except re.error as e:
      raise ConfigError(f'lora.targets={self.targets!r} is not a regex ({e}); pass e.g. '
                        "'attention/(query|value)/kernel$'") from None


@dataclasses.dataclass(frozen=True)
class DpoConfig:
  """Direct preference optimization (data.name='preference'; disttrain/models/preference.py)."""
  beta: float = 0.1  # the rewards' scale: beta x (policy - reference) summed log-probabilities

  def __post_init__(self):
    if self.beta <= 0:
      raise ConfigError(f'dpo.beta={self.beta} must be > 0; TRL uses 0.1')


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """Reinforcement learning with verifiable rewards (data.name='prompts'; training/rollout.py,
  models/grpo.py). global_batch_size counts completions: global_batch_size / group_size prompts a
  step, each sampled group_size times; data.seq_len is the prompts' length (left-padded)."""
  # Reward functions f(prompts, completions, **fields) -> list[float] (TRL's reward_funcs),
  # comma-separated module.function dotted paths; summed. '' = the config file's get_rewards().
  rewards: str = ''
  group_size: int = 8  # completions sampled per prompt; advantages are normalized in the group
  max_new_tokens: int = 64  # a completion's length at most (it ends earlier at the EOS token)
  temperature: float = 1.0  # sampling temperature; the log-probabilities trained use it too
  top_k: int = 0  # sample among the k most likely tokens; 0 = all
  top_p: float = 1.0  # nucleus sampling: the smallest set of tokens reaching this mass
  epsilon: float = 0.2  # the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high]
  epsilon_high: float = -1.0  # -1 = epsilon (DAPO raises it, e.g. 0.28)
  beta: float = 0.0  # the KL penalty to the starting model (k3 estimator); 0 = no reference pass
  # Updates per sampled batch (GRPO's mu); > 1 needs steps_per_dispatch equal to it (the updates
  # of one batch run as one dispatch, so checkpoints fall between batches).
  iterations: int = 1

  def __post_init__(self):
    if self.group_size < 2:
      raise ConfigError(f'grpo.group_size={self.group_size}: an advantage is a reward against its '
                        "group's mean, 0 in a group of one; sample >= 2 completions per prompt "
                        '(e.g. 8)')
    positive('grpo.max_new_tokens', self.max_new_tokens)
    positive('grpo.temperature', self.temperature)
    positive('grpo.top_k', self.top_k, allow_zero=True)
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigError(f'grpo.top_p={self.top_p} must be in (0, 1]')
    positive('grpo.epsilon', self.epsilon)
    if self.epsilon_high != -1.0 and self.epsilon_high <= 0:
      raise ConfigError(f'grpo.epsilon_high={self.epsilon_high} must be > 0, or -1 (= epsilon)')
    positive('grpo.beta', self.beta, allow_zero=True)
    positive('grpo.iterations', self.iterations)

  @property
  def clip_high(self) -> float:
    return self.epsilon if self.epsilon_high == -1.0 else self.epsilon_high

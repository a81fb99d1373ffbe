"""Reward functions for the GRPO tests, named by grpo.rewards=tests.configs.rewards.NAME."""


def too_few(prompts, completions, **unused):
  """One value short."""
  del prompts, unused
  return [0.0] * (len(completions) - 1)


def words(prompts, completions, **unused):
  """A string where a number belongs, after a good value."""
  del prompts, unused
  return [1.0] + ['high'] * (len(completions) - 1)


def length(prompts, completions, **unused):
  """The completion's length in characters."""
  del prompts, unused
  return [float(len(c)) for c in completions]

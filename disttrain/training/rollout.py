"""GRPO's rollout: the loop action that turns a batch of prompts into a batch to train on.

Each step (training/step_loop.py) reads global_batch_size / group_size prompts (data/prompts.py) and
hands them here with the current state:
  1. sample: each prompt repeated group_size times, rows split over the batch axes of the
     training mesh, decoded by models/decoding.py's compiled KV-cache loop from the current
     policy (the LoRA adapters on their frozen base as trained); the key is fold_in(seed,
     step), so a resumed run samples what the uninterrupted one did;
  2. score: every process fetches the completions and calls the reward functions
     f(prompts, completions, completion_ids=..., **fields) -> list[float] (TRL's reward_funcs),
     summed;
  3. advantages: (reward - its group's mean) / (the group's standard deviation + 1e-4), TRL's
     scale_rewards='group' (the deviation with ddof=1, as torch.std);
  4. the rows [prompt | completion] with the completion's tokens counted (models/grpo.py), and
     with grpo.iterations > 1 the sampling policy's log-probabilities, stacked for the
     iterations' updates in one dispatch.
Records gain the step's reward statistics and how its time split between sampling and learning.
Sampling runs on the training layout: no second copy of the weights, no resharding; the decoder
reads fsdp-split weights by gathering them each token, which a separate inference mesh would
avoid at the price of a weight copy per update (docs/post-training.md).
"""

import contextlib
import importlib
import numbers
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from disttrain.config import Config
from disttrain.data import global_arrays, prompts as prompts_lib
from disttrain.data import tokenizer as tokenizer_lib
from disttrain.errors import ConfigError, DataError
from disttrain.models import decoding, grpo, lora, moe, preference
from disttrain.parallel.state import FROZEN

Reward = tuple[str, Callable]
_PASSED = ('prompts', 'completions', 'completion_ids')  # every reward's own arguments


def load_rewards(paths: str, given: Any = None) -> list[Reward]:
  """grpo.rewards' comma-separated module.function paths (importable, or modules in the current
  directory), else the config file's get_rewards()."""
  if paths and os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())  # `disttrain train` from a project: its own rewards module
  rewards = []
  for path in [p.strip() for p in paths.split(',') if p.strip()]:
    module, _, name = path.rpartition('.')
    try:
      fn = getattr(importlib.import_module(module), name) if module else None
    except Exception as e:  # pylint: disable=broad-except  # any import failure is bad input
      raise ConfigError(f'grpo.rewards: {path!r} does not import ({type(e).__name__}: {e}); '
                        'name a module.function on the Python path') from None
    if not callable(fn):
      raise ConfigError(f'grpo.rewards: {path!r} is not a callable module.function; name a '
                        'function f(prompts, completions, **fields) -> list[float]')
    rewards.append((path, fn))
  if callable(given):  # one function, as TRL's reward_funcs takes it
    given = [given]
  for fn in ([] if rewards or given is None else list(given)):
    if not callable(fn):
      raise ConfigError(f'get_rewards() returned {fn!r}, which is not callable; return functions '
                        'f(prompts, completions, **fields) -> list[float]')
    rewards.append((getattr(fn, '__name__', type(fn).__name__), fn))
  if not rewards:
    raise ConfigError("data.name='prompts' trains on rewards, and none is named: set "
                      'grpo.rewards=module.function[,...] or define get_rewards() in the config '
                      'file')
  # Each function its own name (two lambdas, one path twice): the sum keeps every one.
  names = [name for name, _ in rewards]
  return [(name if names.count(name) == 1 else f'{name}_{names[:i].count(name) + 1}', fn)
          for i, (name, fn) in enumerate(rewards)]


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list,
          fields: dict) -> dict[str, np.ndarray]:
  """Each reward function's values [B] (float64), checked: one number per completion."""
  out = {}
  fields = {k: v for k, v in fields.items() if k not in _PASSED}  # as TRL leaves them out
  for name, fn in rewards:
    values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
    values = list(values) if isinstance(values, (list, tuple, np.ndarray)) else values
    if not isinstance(values, list) or len(values) != len(completions):
      got = f'{len(values)} values' if isinstance(values, list) else type(values).__name__
      raise DataError(f'reward {name} returned {got} for {len(completions)} completions; return '
                      'one number per completion')
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Real)]
    if bad:
      raise DataError(f'reward {name} returned {bad[0]!r} ({type(bad[0]).__name__}) among its '
                      'values; return a number per completion')
    out[name] = np.asarray(values, np.float64)
  return out


def advantages(total: np.ndarray, group: int) -> np.ndarray:
  """(reward - group mean) / (group std with ddof=1 + 1e-4), rows grouped consecutively."""
  grouped = total.reshape(-1, group)
  mean = grouped.mean(axis=1, keepdims=True)
  std = grouped.std(axis=1, ddof=1, keepdims=True)
  return ((grouped - mean) / (std + 1e-4)).reshape(-1).astype(np.float32)


def _policy_model(model):
  """The model the policy samples from: under the reference wrapper; LoRA's adapted form."""
  while isinstance(model, preference.WithReference):
    model = model.model
  return model


def _fetch(x: jax.Array) -> np.ndarray:
  """The whole of a global array on every process."""
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class Rollout:
  """Prompts + state -> the batch of one GRPO step and the host's record fields (module doc)."""

  def __init__(self, cfg: Config, model, mesh, batch_sharding, rewards: list[Reward]):
    g = cfg.grpo
    self.cfg, self.g, self.rewards = cfg, g, rewards
    self.group, self.rows = g.group_size, cfg.global_batch_size
    self.prompts_per_step = cfg.global_batch_size // g.group_size
    self.prompt_len, self.new = cfg.data.seq_len, g.max_new_tokens
    self.prompt_sharding = NamedSharding(mesh, P())  # a few ids, on every device
    self.assemble = global_arrays.Assembler(batch_sharding, cfg.global_batch_size)
    self.stacked = global_arrays.stacked_sharding(batch_sharding, g.iterations)
    self.prompt_set = prompts_lib.load(cfg.data.train_files, 'data.train_files',  # read once:
                                       cfg.data.tokenizer, cfg.data.seq_len,  # as the source
                                       cfg.data.sft.chat_template, jax.process_index() == 0)
    count = len(self.prompt_set.lines)
    if count < self.prompts_per_step:  # the iterator's line would count completions as prompts
      raise DataError(f'data.train_files has {count} prompts, fewer than the '
                      f'{self.prompts_per_step} a step samples (global_batch_size='
                      f'{cfg.global_batch_size} completions / grpo.group_size={g.group_size}); '
                      f'use more prompts or global_batch_size <= {count * g.group_size}')
    self.tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
    policy = _policy_model(model)
    if not hasattr(policy, 'family'):
      raise ConfigError(f"data.name='prompts' samples completions from a language model; "
                        f'{type(policy).__name__} is not one (use a gpt, llama, qwen, mistral, '
                        'mixtral or gemma model)')
    vocab = policy.cfg.vocab_size
    self.stops = self.tokenizer.stop_ids(vocab)  # EOS, and an instruct model's end of turn
    context = policy.cfg.learned_positions
    if context and self.prompt_len + self.new > context:
      raise ConfigError(f'data.seq_len={self.prompt_len} prompt tokens + grpo.max_new_tokens='
                        f'{self.new} exceed the model\'s {context} positions; shorten one')
    self.adapters = isinstance(policy, lora.LoraModel)
    # Dropless, as generate's: with a capacity a prompt's left padding took expert slots and
    # its sample depended on data.seq_len.
    self.module = moe.dropless((policy.adapted_model if self.adapters else policy).module)
    loop = decoding.decode_loop(self.module, self.new, self.stops, g.temperature, g.top_k, g.top_p)

    def sample(params, mutable, tokens, segments, positions, key):
      if self.adapters:
        params = lora.join(mutable[FROZEN], params)
      return loop(params, tokens, segments, positions, jax.random.wrap_key_data(key))[0]
    self._sample, self._compiled = jax.jit(sample), None
    self._prepare = None
    if g.iterations > 1:
      def prepare(params, mutable, batch):  # the sampling policy's log-probs; K copies
        outputs, _, _ = policy.apply({'params': params, **mutable}, batch, train=False, rng=None)
        batch = {**batch, 'old_logprobs': grpo.token_logprobs(outputs, batch, g.temperature)[0]}
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (g.iterations,) + x.shape), batch)
      self._prepare = jax.jit(prepare, out_shardings=self.stacked)
    self._learn_since = None  # when the previous rollout handed its batch to the step

  @property
  def step_spec(self) -> dict:
    """One training row as ShapeDtypeStructs (the state and steps are built for it)."""
    t = self.prompt_len + self.new
    spec = {name: jax.ShapeDtypeStruct((1, t), jnp.int32)
            for name in ('tokens', 'targets', 'positions', 'segment_ids')}
    spec.update(loss_mask=jax.ShapeDtypeStruct((1, t), jnp.int8),
                advantages=jax.ShapeDtypeStruct((1,), jnp.float32))
    if self.g.iterations > 1:
      spec['old_logprobs'] = jax.ShapeDtypeStruct((1, t), jnp.float32)
    return spec

  def __call__(self, state, prompt_batch: dict, step: int,
               compiling: Callable[[], Any] = contextlib.nullcontext) -> tuple[dict, dict]:
    jax.block_until_ready(state.params)  # the previous update has finished: the policy is fresh
    start = time.perf_counter()
    learn_seconds = None if self._learn_since is None else start - self._learn_since
    local = lambda x: np.asarray(x.addressable_data(0))  # replicated: every process has all
    index = np.repeat(local(prompt_batch['index']), self.group)
    prompt = np.repeat(local(prompt_batch['prompt']), self.group, axis=0)
    mask = np.repeat(local(prompt_batch['prompt_mask']), self.group, axis=0).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    rows = self.assemble.rows
    inputs = self.assemble({'tokens': prompt[rows], 'segments': mask[rows],
                            'positions': positions[rows]})
    key = jax.random.key_data(jax.random.fold_in(jax.random.key(self.cfg.seed), step))
    args = (state.params, state.mutable, inputs['tokens'], inputs['segments'],
            inputs['positions'], key)
    if self._compiled is None:  # once: its compilation is not sampling time
      began = time.perf_counter()
      with compiling():  # the loop's phases('compile'): not training time either
        self._compiled = self._sample.lower(*args).compile()
      start += time.perf_counter() - began
    completions = _fetch(self._compiled(*args))
    sample_seconds = time.perf_counter() - start
    ends = np.isin(completions, self.stops)
    ended = ends.any(axis=1)
    lengths = np.where(ended, ends.argmax(axis=1) + 1, self.new)  # the EOS is trained
    text_ids = [row[:n - int(e)].tolist() for row, n, e in zip(completions, lengths, ended)]
    texts = [self.tokenizer.decode(ids) for ids in text_ids]
    prompts, fields = self.prompt_set.reward_inputs(index)
    as_given = [[{'role': 'assistant', 'content': t}] for t in texts] if self.prompt_set.chat \
        else texts
    values = score(self.rewards, prompts, as_given, text_ids, fields)
    total = np.sum(list(values.values()), axis=0)
    batch = self._rows(prompt, mask, completions, lengths, advantages(total, self.group))
    batch = self.assemble({k: v[rows] for k, v in batch.items()})
    if self._prepare is not None:
      batch = self._prepare(state.params, state.mutable, batch)
    record = {'reward': float(total.mean()),
              'reward_std': float(total.reshape(-1, self.group).std(axis=1, ddof=1).mean()),
              **{f'reward/{name}': float(v.mean()) for name, v in values.items()},
              'completion_length': float(lengths.mean()),
              'completion_length_max': float(lengths.max()),
              'completion_eos_fraction': float(ended.mean()),
              'sample_seconds': sample_seconds,
              'sample_tokens_per_sec': float(lengths.sum()) / max(sample_seconds, 1e-9)}
    if learn_seconds is not None:  # the previous step's update, measured up to now
      trained = self.rows * (self.prompt_len + self.new) * self.g.iterations
      record.update(learn_seconds=learn_seconds,
                    learn_tokens_per_sec=trained / max(learn_seconds, 1e-9),
                    sample_fraction=sample_seconds / (sample_seconds + learn_seconds))
    self._learn_since = time.perf_counter()
    k = self.g.iterations  # one value per step of the dispatch: records average them
    return batch, {name: np.full(k, v) if k > 1 else v for name, v in record.items()}

  def _rows(self, prompt, mask, completions, lengths, advantage) -> dict:
    """[prompt | completion] rows: targets and loss mask on the completion's tokens."""
    b, p, n = len(prompt), self.prompt_len, self.new
    tokens = np.concatenate([prompt, completions], axis=1).astype(np.int32)
    counted = np.arange(n)[None, :] < lengths[:, None]
    targets = np.full((b, p + n), -1, np.int32)
    targets[:, p - 1:p - 1 + n] = np.where(counted, completions, -1)
    loss_mask = np.zeros((b, p + n), np.int8)
    loss_mask[:, p - 1:p - 1 + n] = counted
    segments = np.concatenate([mask, np.ones((b, n), np.int32)], axis=1)
    positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0).astype(np.int32)
    return {'tokens': tokens, 'targets': targets, 'loss_mask': loss_mask,
            'positions': positions, 'segment_ids': segments.astype(np.int32),
            'advantages': advantage}

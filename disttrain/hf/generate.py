"""Sampling from a trained language model: prefill, then KV-cache decoding in one compiled loop.

  disttrain generate --workdir=RUN_DIR --prompt='def main' [--prompt=...]
      [--max_new_tokens=64 --temperature=0 --top_k=0 --top_p=1 --seed=0 --step=N --json=F]
  disttrain generate --hf_dir=HF_DIR --prompt=...           # a Hugging Face model
  disttrain generate --hf_dir=HF_DIR --chat --prompt=...    # a user turn in its chat template

`disttrain.generate(model, params, prompts, ...)` is the Python form. Prompts of different
lengths are left-padded to one length (padding is segment 0, which no token attends to, and
positions count from each prompt's first token), prefilled in one forward pass that writes the
cache, then decoded one token per step inside a `lax.while_loop` until every row has produced a
stop id (EOS; an instruct model's end of turn from generation_config.json) or max_new_tokens:
one compilation per (batch, prompt bucket, length), none per token. The cache is an argument and
a result of the model, never training state. Temperature 0 is greedy. The loop itself is
models/decoding.py (the scorer and GRPO rollouts run it too).
"""

import dataclasses
import functools
import json
import sys
import time
import types
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from disttrain import commandline
from disttrain.data import chat
from disttrain.errors import ConfigError, one_line_errors
from disttrain.models import decoding, moe

_BUCKET = 8  # prompt lengths are padded up to a multiple of this (fewer compilations)


@dataclasses.dataclass
class Generation:
  """New tokens per prompt (up to and excluding the stop id), and how long it took."""
  tokens: list[list[int]]
  logprobs: list[list[float]]  # the model's log-probability of each new token (temperature 1)
  seconds: float  # the compiled loop, without compilation
  compile_seconds: float
  traces: int  # times the loop was traced in this process (1: compiled once per shape)

  @property
  def tokens_per_second(self) -> float:
    return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


@functools.lru_cache(maxsize=16)
def _compiled_loop(module, max_new: int, stops: tuple[int, ...], temperature: float, top_k: int,
                   top_p: float):
  """The jitted loop of these settings (one per setting: each traces once per shape)."""
  loop = decoding.decode_loop(module, max_new, stops, temperature, top_k, top_p)
  return jax.jit(lambda params, t, s, q, key: loop(params, t, s, q, jax.random.wrap_key_data(key)))


def _check_settings(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
  """transformers' limits on the sampling settings, as one line each."""
  for ok, name, value, want in (
      (max_new_tokens >= 1, 'max_new_tokens', max_new_tokens, 'an int >= 1'),
      (temperature >= 0, 'temperature', temperature, '0 (greedy) or more'),
      (top_k >= 0, 'top_k', top_k, '0 (no limit) or more'),
      (0 < top_p <= 1, 'top_p', top_p, 'in (0, 1]; 1 keeps every token')):
    if not ok:
      raise ConfigError(f'{name}={value} is out of range; pass {want}')


def generate(model, params, prompts: list[list[int]], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | Sequence[int] | None = None, mesh=None,
             context: int | None = None) -> Generation:
  """Continues each prompt (token ids) with up to max_new_tokens tokens.

  Args:
    model: a disttrain.models.language_model.LanguageModel (or its Decoder module).
    params: its parameters, anywhere (e.g. sharded on the run's mesh).
    prompts: token ids per prompt (at least one token each).
    eos_id: stop a row at this token, or at the first of these (None: never).
    mesh: where the prompts go (replicated); default: the parameters' devices.
    context: the longest sequence the model takes; longer prompts + max_new_tokens are refused.
  """
  module = moe.dropless(getattr(model, 'module', model))
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ConfigError('every prompt needs at least one token')
  _check_settings(max_new_tokens, temperature, top_k, top_p)
  vocab = getattr(getattr(module, 'cfg', None), 'vocab_size', None)
  beyond = [t for p in prompts for t in p if vocab is not None and not 0 <= t < vocab]
  if beyond:  # the embedding's padded rows would read them silently
    raise ConfigError(f'prompt token id {beyond[0]} is outside the model\'s {vocab} ids; use the '
                      'tokenizer the model was trained with (--tokenizer)')
  longest = max(len(p) for p in prompts)
  p = -(-longest // _BUCKET) * _BUCKET
  if context is not None and longest + max_new_tokens > context:
    raise ConfigError(f'a prompt of {longest} tokens + max_new_tokens={max_new_tokens} is longer '
                      f'than the model context of {context} tokens; shorten the prompt or '
                      'generate fewer tokens')
  tokens, segments, positions = decoding.left_padded(prompts, p)
  stops = decoding.stop_ids(eos_id)
  if mesh is None:
    mesh = getattr(getattr(jax.tree.leaves(params)[0], 'sharding', None), 'mesh', None)
  put = lambda x: jax.device_put(x, None if mesh is None else NamedSharding(mesh, P()))
  args = (params, put(tokens), put(segments), put(positions),
          put(jax.random.key_data(jax.random.key(seed))))
  fn = _compiled_loop(module, max_new_tokens, stops, float(temperature), int(top_k),
                      float(top_p))
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_seconds = time.perf_counter() - start
  start = time.perf_counter()
  out, logprobs = jax.block_until_ready(compiled(*args))
  seconds = time.perf_counter() - start
  new, scores = [], []
  for row, row_logprobs in zip(np.asarray(out), np.asarray(logprobs)):
    n = len(decoding.until_stop(row, stops))
    new.append([int(t) for t in row[:n]])
    scores.append([float(x) for x in row_logprobs[:n]])
  return Generation(new, scores, seconds, compile_seconds, decoding.TRACES[0])


class SampleAtEnd:
  """A callback that prints a greedy continuation of each prompt when the run ends (process 0),
  with the run's model and data.tokenizer: what example configs return from get_callbacks."""

  def __init__(self, cfg, prompts: list[str], max_new_tokens: int = 48):
    from disttrain import models  # pylint: disable=g-import-not-at-top
    from disttrain.data import tokenizer as tokenizer_lib
    self.model = models.build(cfg.model, cfg.precision.compute_dtype, cfg.row_tokens)
    self.tokenizer = tokenizer_lib.load(cfg.data.tokenizer)
    self.prompts, self.max_new_tokens = prompts, max_new_tokens
    self.context = self.model.cfg.learned_positions or cfg.model.max_seq_len or cfg.row_tokens
    self.lora_scale = cfg.lora.alpha / cfg.lora.rank if cfg.lora.rank else 0.0

  def on_end(self, result) -> None:
    prompts = [self.tokenizer.encode(p) for p in self.prompts]
    params = result.state.params
    if self.lora_scale:  # a LoRA run's params are its adapters; the base is frozen beside them
      from disttrain.models import lora  # pylint: disable=g-import-not-at-top
      from disttrain.parallel.state import FROZEN  # pylint: disable=g-import-not-at-top
      params = lora.merge(result.state.mutable[FROZEN], params, self.lora_scale)
    # A run of short rows: fewer new tokens, never a finished run's error at its end.
    room = self.context - max(map(len, prompts))
    if room < 1:
      if jax.process_index() == 0:
        print(f'sample: none, a prompt of {self.context - room} tokens fills the model\'s '
              f'context of {self.context}', flush=True)
      return
    out = generate(self.model, params, prompts,
                   max_new_tokens=min(self.max_new_tokens, room),
                   eos_id=self.tokenizer.stop_ids(self.model.cfg.vocab_size), context=self.context)
    if jax.process_index() == 0:
      for prompt, ids, new in zip(self.prompts, prompts, out.tokens):
        print(f'sample: {prompt + self.tokenizer.continuation(ids, new)!r}', flush=True)


class _CallableModule(types.ModuleType):
  """`disttrain.generate(...)` calls generate() even where this module is the attribute."""

  def __call__(self, *args, **kwargs):
    return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


def main(argv) -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from disttrain.hf import trained  # pylint: disable=g-import-not-at-top
  del argv
  f = flags.FLAGS
  if f.fake_devices:
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', f.fake_devices)
  ignored = [name for name in ('top_k', 'top_p') if f[name].present]
  if ignored and f.temperature == 0:  # greedy decoding takes the most likely token anyway
    raise ConfigError(f'--{ignored[0]} chooses among the tokens to sample, but --temperature=0 is '
                      'greedy; set --temperature > 0 to sample, or drop it')
  commandline.output_file('json', f.json)  # before the model loads and samples
  lm = trained.load(workdir=f.workdir, hf_dir=f.hf_dir, step=f.step, mesh=f.mesh,
                    tokenizer=f.tokenizer, ema=f.ema)
  prompts = [lm.tokenizer.encode(text) for text in f.prompt]
  if f.chat:  # each prompt a user turn in the tokenizer's own chat template
    template = chat.load(lm.tokenizer.file, 'auto')
    if template is None:
      raise ConfigError(f'--chat: the tokenizer {lm.tokenizer.path or "(bytes)"!r} has no chat '
                        'template (no chat_template.jinja, none in tokenizer_config.json); leave '
                        '--chat out, or pass --tokenizer=DIR of one that has')
    prompts = [lm.tokenizer.encode_whole([(template.render(
        [{'role': 'user', 'content': text}], True, example=f'--prompt={text!r}'), False)])[0]
               for text in f.prompt]
  stops = lm.stop_ids()
  result = generate(lm.model, lm.params, prompts, max_new_tokens=f.max_new_tokens,
                    temperature=f.temperature, top_k=f.top_k, top_p=f.top_p, seed=f.seed,
                    eos_id=stops, mesh=lm.mesh, context=lm.context)
  count = sum(len(t) for t in result.tokens)
  summary = (f'{count} new tokens from {lm.source} on {lm.mesh.size} devices '
             f'{dict(lm.mesh.shape)} in {result.seconds:.2f}s: '
             f'{result.tokens_per_second:,.1f} tokens/s (compiled in '
             f'{result.compile_seconds:.1f}s)')
  if f.json:
    out = _as_json(lm, f, prompts, result, stops)
    if f.json == '-':
      print(json.dumps(out, indent=1), flush=True)
      return
    with open(f.json, 'w', encoding='utf-8') as file:
      json.dump(out, file, indent=1)
  for text, ids, new in zip(f.prompt, prompts, result.tokens):
    print(f'{text}{lm.tokenizer.continuation(ids, new)}')
    print('---')
  print(summary + (f'; JSON in {f.json}' if f.json else ''), flush=True)


def _as_json(lm, f, prompts: list[list[int]], result: Generation, stops) -> dict:
  """--json: per prompt its tokens, the new tokens, text and log-probabilities, and why it
  stopped; the settings and the speed."""
  samples = [{'prompt': text, 'prompt_tokens': ids, 'tokens': new,
              'text': lm.tokenizer.continuation(ids, new), 'logprobs': [float(x) for x in logprobs],
              'stop': 'length' if len(new) == f.max_new_tokens else 'eos'}
             for text, ids, new, logprobs in zip(f.prompt, prompts, result.tokens, result.logprobs)]
  return {'source': lm.source, 'mesh': dict(lm.mesh.shape),
          'eos_id': stops[0] if stops else None, 'stop_ids': list(stops),
          'settings': {'max_new_tokens': f.max_new_tokens, 'temperature': f.temperature,
                       'top_k': f.top_k, 'top_p': f.top_p, 'seed': f.seed},
          'samples': samples, 'seconds': result.seconds,
          'compile_seconds': result.compile_seconds,
          'tokens_per_second': result.tokens_per_second}


if __name__ == '__main__':
  from absl import flags, logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)  # orbax's info and read-only notes
  flags.DEFINE_string('workdir', '', 'A run directory with a checkpoint.')
  flags.DEFINE_string('hf_dir', '', 'Or a Hugging Face model directory.')
  flags.DEFINE_multi_string('prompt', None, 'Prompt text; repeat for a batch.')
  flags.DEFINE_integer('max_new_tokens', 64, 'Tokens to generate per prompt at most.')
  flags.DEFINE_float('temperature', 0.0, '0 = greedy.')
  flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens; 0 = all.')
  flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling: the smallest set reaching this mass.')
  flags.DEFINE_integer('seed', 0, 'Sampling seed.')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
  flags.DEFINE_string('tokenizer', None, "Tokenizer file (default: the run's data.tokenizer).")
  flags.DEFINE_bool('ema', False, 'Sample from the moving average of the parameters.')
  flags.DEFINE_string('mesh', '', "A mesh instead of the run's (axes not named are 1), e.g. "
                      'data=-1 or fsdp=8.')
  flags.DEFINE_integer('fake_devices', None, 'Run on N CPU devices.', lower_bound=1)
  flags.DEFINE_bool('chat', False, "Each prompt is a user turn, rendered by the tokenizer's own "
                    'chat template with its generation prompt.')
  flags.DEFINE_string('json', '', 'Also write the samples as JSON (token ids, text, '
                      'log-probabilities, stop reason) to this file; - = stdout, instead of text.')
  flags.mark_flag_as_required('prompt')
  commandline.run(one_line_errors(main))

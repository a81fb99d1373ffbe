"""Sampling speed: disttrain.generate's KV-cache decoding against a loop without a cache.

  python benchmarks/generate.py [--size=bench] [--batch=8] [--prompt_len=32] [--new_tokens=256]

Both sides run the same Llama (launch/configs/llama.py at --size, random weights, float32) on
the same prompts, greedily, as one compiled loop each (no recompilation per token):
  kv_cache   disttrain.generate: the prompt prefilled once, then one token per step against
             the cache (attention over the cached keys, projections of the new token only)
  no_cache   every step recomputes the whole sequence (prompt + tokens so far, in a buffer of
             the final length) and takes the last position's argmax
Windows alternate (cache, none, none, cache, ...) and the ratio is the median of paired
tokens/s ratios; the fraction of equal tokens is reported. Compilation is excluded.
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import disttrain
from disttrain import config as config_lib, models

_SIZE = flags.DEFINE_string('size', 'bench', "bench (4 x 256, ~4 M parameters) or a size of "
                            "launch/configs/llama.py ('tiny', ...)")
_BATCH = flags.DEFINE_integer('batch', 8, 'Prompts per call.')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 32, 'Tokens per prompt.')
_NEW = flags.DEFINE_integer('new_tokens', 256, 'Tokens generated per prompt.')
_WINDOWS = flags.DEFINE_integer('windows', 5, 'Timed calls per side.')
_JSON = flags.DEFINE_string('json', None, 'Write the result here.')

_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch',
                        'configs', 'llama.py')


def _model():
  import runpy  # pylint: disable=g-import-not-at-top
  size = 'tiny' if _SIZE.value == 'bench' else _SIZE.value
  cd = runpy.run_path(_CONFIGS)['get_config'](size)
  if _SIZE.value == 'bench':
    cd.model.hidden, cd.model.mlp_dim, cd.model.num_heads, cd.model.num_kv_heads = 256, 768, 8, 2
    cd.model.vocab_size = 512
  cfg = config_lib.from_config_dict(cd)
  model = models.build(cfg.model, 'float32', _PROMPT_LEN.value + _NEW.value)
  tokens = jnp.zeros((1, 8), jnp.int32)
  params = jax.jit(lambda: model.init(jax.random.key(0), {'tokens': tokens})['params'])()
  return model, params


def _no_cache_loop(model, max_new: int):
  """Greedy decoding by recomputing the full sequence every step (one compiled fori_loop)."""
  module = model.module

  @jax.jit
  def run(params, prompts_BxP):
    b, p = prompts_BxP.shape
    buffer = jnp.zeros((b, p + max_new), jnp.int32).at[:, :p].set(prompts_BxP)

    def body(i, buffer):
      logits = module.apply({'params': params}, buffer, False)  # causal: later slots unseen
      token = jnp.argmax(logits[:, p + i - 1], axis=-1).astype(jnp.int32)
      return buffer.at[:, p + i].set(token)
    return jax.lax.fori_loop(0, max_new, body, buffer)[:, p:]
  return run


def main(argv) -> None:
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  model, params = _model()
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, model.cfg.vocab_size, (_BATCH.value, _PROMPT_LEN.value))
  prompt_list = [list(map(int, row)) for row in prompts]
  new = _NEW.value
  cached = lambda: disttrain.generate(model, params, prompt_list, max_new_tokens=new)
  first = cached()  # compiles (and caches the compiled loop)
  baseline = _no_cache_loop(model, new)
  reference = np.asarray(baseline(params, jnp.asarray(prompts)))  # compiles
  # Random weights give close logits: a near-tie may break either way between the two forms, so
  # agreement is reported (the tests hold the cache to the full forward pass exactly).
  agree = float(np.mean(np.asarray(first.tokens) == reference))
  cache_tps, none_tps = [], []
  count = _BATCH.value * new
  for w in range(_WINDOWS.value):
    for side in ((0, 1) if w % 2 == 0 else (1, 0)):
      if side == 0:
        cache_tps.append(count / cached().seconds)
      else:
        start = time.perf_counter()
        jax.block_until_ready(baseline(params, jnp.asarray(prompts)))
        none_tps.append(count / (time.perf_counter() - start))
  ratio = statistics.median(a / b for a, b in zip(cache_tps, none_tps))
  params_count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  result = {'size': _SIZE.value, 'parameters': params_count, 'batch': _BATCH.value,
            'prompt_len': _PROMPT_LEN.value, 'new_tokens': new,
            'kv_cache_tokens_per_sec': round(statistics.median(cache_tps), 1),
            'no_cache_tokens_per_sec': round(statistics.median(none_tps), 1),
            'ratio': round(ratio, 2), 'compile_sec': round(first.compile_seconds, 2),
            'equal_tokens': round(agree, 4),
            'device': jax.devices()[0].device_kind}
  print(f'{params_count / 1e6:.1f} M parameters, batch {_BATCH.value}, prompt '
        f'{_PROMPT_LEN.value} + {new} new tokens: kv cache '
        f'{result["kv_cache_tokens_per_sec"]:,.0f} tokens/s, no cache '
        f'{result["no_cache_tokens_per_sec"]:,.0f} tokens/s: {ratio:.1f}x '
        f'(median of {_WINDOWS.value} paired windows; compile {first.compile_seconds:.1f}s; '
        f'{100 * agree:.1f} % equal tokens)')
  if _JSON.value:
    with open(_JSON.value, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=2)


if __name__ == '__main__':
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  app.run(main)

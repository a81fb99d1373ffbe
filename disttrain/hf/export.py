"""Write a run's checkpoint as a Hugging Face model directory that `transformers` loads.

  disttrain export --workdir=RUN_DIR --out=HF_DIR [--step=N] [--dtype=bfloat16] [--ema]

OUT gets config.json (LlamaForCausalLM or GPT2LMHeadModel), the weights as safetensors (split
into files of at most --max_shard_gb, with an index, written one tensor at a time) and the run's
tokenizer (tokenizer.json and its tokenizer_config.json, or tokenizer.model). Only the parameters
are read from the checkpoint, onto this host's first device.
"""

import json
import os
import shutil
import sys
import time

from absl import app, flags
import numpy as np

_WORKDIR = flags.DEFINE_string('workdir', None, 'A run directory with a checkpoint.')
_OUT = flags.DEFINE_string('out', None, 'The Hugging Face directory to write (created).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Weights dtype.')
_EMA = flags.DEFINE_bool('ema', False, 'Export the moving average of the parameters.')
_MAX_SHARD_GB = flags.DEFINE_float('max_shard_gb', 2.0, 'Largest safetensors file, GiB.')
flags.mark_flags_as_required(['workdir', 'out'])


def export(workdir: str, out: str, step: int | None = None, dtype: str = 'float32',
           ema: bool = False, max_shard_bytes: int = 2 * 2**30) -> str:
  """Writes the model of `workdir` to `out`; returns a one-line summary."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from disttrain.hf import weights as hf, config as hf_config, tensorfiles, trained
  from disttrain.parallel import mesh
  start = time.perf_counter()
  lm = trained.load(workdir=workdir, step=step, devices=jax.devices()[:1], ema=ema,
                    mesh={axis: 1 for axis in mesh.AXES})
  family = lm.model.family
  if lm.model.cfg.num_experts:
    from disttrain.errors import ConfigError  # pylint: disable=g-import-not-at-top
    raise ConfigError(f'{workdir} holds a mixture-of-experts model (model.num_experts='
                      f'{lm.model.cfg.num_experts}), which the {family} Hugging Face layout '
                      'has no place for; export a dense model (model.num_experts=0)')
  np_dtype = np.float32 if dtype == 'float32' else ml_dtypes.bfloat16
  os.makedirs(out, exist_ok=True)
  special = {k: v for k, v in (('bos_token_id', lm.tokenizer.bos_id),
                               ('eos_token_id', lm.tokenizer.eos_id))
             if v is not None and v < lm.model.cfg.vocab_size}
  config = hf_config.for_export(family, lm.cfg.model, lm.model.cfg, dtype, special)
  if family != 'gpt':  # rotary families: the longest sequence the run knows the model takes
    config['max_position_embeddings'] = lm.context
  files = tensorfiles.write(out, hf.export_tensors(family, lm.model.cfg, lm.params, np_dtype),
                            max_shard_bytes, metadata={'format': 'pt'})
  with open(os.path.join(out, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
  copied = _copy_tokenizer(lm.tokenizer, out)
  size = sum(os.path.getsize(os.path.join(out, name)) for name in files)
  return (f'exported {lm.source} ({hf_config.FAMILIES[family]}, {dtype}'
          f'{", EMA" if ema else ""}) to {out}: {len(files)} safetensors file(s), '
          f'{size / 2**20:,.1f} MiB, tokenizer {copied or "none (bytes)"}, in '
          f'{time.perf_counter() - start:.1f}s')


def _copy_tokenizer(tokenizer, out: str) -> str:
  """The run's tokenizer files beside the weights, named as transformers looks for them (with a
  tokenizer_config.json naming the end-of-sequence token when the run's has none)."""
  if tokenizer.kind == 'bytes':
    return ''
  name = 'tokenizer.json' if tokenizer.kind == 'hf' else 'tokenizer.model'
  shutil.copyfile(tokenizer.file, os.path.join(out, name))
  config = os.path.join(os.path.dirname(tokenizer.file), 'tokenizer_config.json')
  if os.path.isfile(config):
    shutil.copyfile(config, os.path.join(out, 'tokenizer_config.json'))
  elif tokenizer.kind == 'hf' and tokenizer.eos_id is not None:
    eos = tokenizer.id_to_token(tokenizer.eos_id)
    with open(os.path.join(out, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
      json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': eos}, f, indent=2)
  return name


def main(argv) -> None:
  if len(argv) > 1:
    _fail(f'unexpected arguments {argv[1:]}; pass settings as flags, e.g. --workdir=RUN_DIR')
  from disttrain.errors import DisttrainError  # pylint: disable=g-import-not-at-top
  try:
    print(export(_WORKDIR.value, _OUT.value, _STEP.value, _DTYPE.value, _EMA.value,
                 int(_MAX_SHARD_GB.value * 2**30)), flush=True)
  except DisttrainError as e:
    _fail(f'{type(e).__name__}: {e}')


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(2)


if __name__ == '__main__':
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)  # orbax's info and read-only notes
  app.run(main)

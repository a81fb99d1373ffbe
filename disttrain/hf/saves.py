"""Hugging Face directories: written by `disttrain export` from a checkpoint, and during a run.

`write(out, ...)` makes a directory `transformers` loads: config.json, the weights as
safetensors (one tensor fetched at a time, files of at most max_shard_bytes with an index), the
tokenizer (tokenizer.json or tokenizer.model, tokenizer_config.json with its chat template, and
chat_template.jinja when the tokenizer has one). `out` may be a gs:// or s3:// URL: the files
stream there, with no local copy. Parameters split over several processes are gathered one
tensor at a time by every process (a collective); process 0 alone writes.

`hf_save_every_steps=N` in a run writes DIR/hf/<step>/ every N steps and at the last step
(`RunSaves`, called by the loop after the checkpoint of that step; config.json last, and a
resume writes a save its checkpoint's step missed), so a run can be evaluated or
served by Hugging Face tools while it trains; `disttrain export` stays for any checkpoint later.
"""

import json
import os
import time

import jax
import numpy as np

from disttrain.config import Config
from disttrain.hf import exported_config, tensorfiles, weights as hf
from disttrain.parallel import distributed
from disttrain.storage import urls


def _fetch(x) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def write(out: str, family: str, model_cfg, decoder, params, tokenizer, context: int,
          dtype: str = 'float32', max_shard_bytes: int = 2 * 2**30) -> tuple[list[str], int, str]:
  """Writes the directory (every process calls it); (safetensors names, bytes, tokenizer)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  np_dtype = np.float32 if dtype == 'float32' else ml_dtypes.bfloat16
  tensors = [(name, shape, dt, lambda p=produce: _fetched(p))
             for name, shape, dt, produce in hf.export_tensors(family, decoder, params, np_dtype)]
  if jax.process_index() != 0:
    for *_, produce in tensors:  # take part in every gather
      produce()
    return [], 0, ''
  urls.path(out).mkdir(parents=True, exist_ok=True)
  special = {k: v for k, v in (('bos_token_id', tokenizer.bos_id),
                               ('eos_token_id', tokenizer.eos_id))
             if v is not None and v < decoder.vocab_size}
  config = exported_config.for_export(family, model_cfg, decoder, dtype, special)
  if family != 'gpt':  # rotary families: the longest sequence the run knows the model takes
    config['max_position_embeddings'] = context
  files = tensorfiles.write(out, tensors, max_shard_bytes, metadata={'format': 'pt'})
  copied = _copy_tokenizer(tokenizer, out)
  # Last: a directory without it (a process killed while writing) is not a model anyone loads.
  urls.write_text(urls.join(out, 'config.json'), json.dumps(config, indent=2))
  size = sum(urls.path(urls.join(out, name)).stat().length if urls.is_bucket(out)
             else os.path.getsize(os.path.join(out, name)) for name in files)
  return files, size, copied


def _fetched(produce):
  """produce() with its device arrays fetched (gathered across processes when split)."""
  return produce(_fetch)


def _copy_tokenizer(tokenizer, out: str) -> str:
  """The run's tokenizer files beside the weights, named as transformers looks for them (with a
  tokenizer_config.json naming the end-of-sequence token when the run's has none), and its
  generation_config.json (the stop ids of an instruct model's turns)."""
  if tokenizer.kind == 'bytes':
    return ''
  name = 'tokenizer.json' if tokenizer.kind == 'hf' else 'tokenizer.model'
  folder = os.path.dirname(tokenizer.file)
  copies = [(tokenizer.file, name)] + [
      (os.path.join(folder, n), n)
      for n in ('tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja',
                'generation_config.json')
      if os.path.isfile(os.path.join(folder, n))]
  for source, target in copies:
    with open(source, 'rb') as f:
      urls.path(urls.join(out, target)).write_bytes(f.read())
  if tokenizer.kind == 'hf' and tokenizer.eos_id is not None and not os.path.isfile(
      os.path.join(folder, 'tokenizer_config.json')):
    eos = tokenizer.id_to_token(tokenizer.eos_id)
    urls.write_text(urls.join(out, 'tokenizer_config.json'), json.dumps(
        {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': eos}, indent=2))
  return ', '.join(target for _, target in copies)


class RunSaves:
  """DIR/hf/<step>/ every cfg.hf_save_every_steps steps and at the last (a loop action)."""

  def __init__(self, cfg: Config, model, workdir: str, tokenizer, say):
    if cfg.hf_save_every_steps:
      exported_config.check_exportable(
          model, f'hf_save_every_steps={cfg.hf_save_every_steps}: the run')
    self.cfg, self.model, self.workdir, self.tokenizer, self.say = (cfg, model, workdir,
                                                                    tokenizer, say)

  def due(self, step_no: int, last: bool) -> bool:
    every = self.cfg.hf_save_every_steps
    return bool(every) and (last or step_no % every == 0)

  def missing(self, step_no: int, last: bool) -> bool:
    """Due at step_no but not written whole (killed while writing, after its checkpoint
    committed: the resume starts after it). Process 0's disk decides; call on every process."""
    out = urls.join(self.workdir, 'hf', str(step_no), 'config.json')
    return self.due(step_no, last) and distributed.any_process(
        jax.process_index() == 0 and not urls.path(out).exists())

  def save(self, step_no: int, params) -> str:
    """Writes DIR/hf/<step_no> (every process calls it); its URL."""
    start = time.perf_counter()
    out = urls.join(self.workdir, 'hf', str(step_no))
    context = (self.model.cfg.learned_positions or self.cfg.model.max_seq_len
               or self.cfg.data.seq_len)
    files, size, _ = write(out, self.model.family, self.cfg.model, self.model.cfg, params,
                           self.tokenizer, context, self.cfg.hf_save_dtype)
    if jax.process_index() == 0:
      self.say(f'step {step_no}: Hugging Face save in {out} ({len(files)} safetensors file(s), '
               f'{size / 2**20:,.1f} MiB, {time.perf_counter() - start:.1f}s)')
    return out

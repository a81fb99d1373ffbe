"""The GPT config's small transformer trained from a flat token file (nanoGPT's .bin format).

  disttrain convert --source=text --format=tokens --out=data/text
  python launch/train.py --config=launch/configs/lm_tokens.py --workdir=runs/lm --fake_devices=8

The converter writes the first 2 MiB of the Python standard library's source as byte ids
(uint16): data/text/train.bin and the last 32,769 ids as data/text/eval.bin. The files are
memory-mapped and read as windows of data.seq_len + 1 tokens; every window is checked against
model.vocab_size.
"""

import importlib.util
import os

_GPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpt.py')


def get_config():
  spec = importlib.util.spec_from_file_location('gpt_config', _GPT)
  gpt = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gpt)
  cfg = gpt.get_config('small')
  cfg.data.name = 'tokens'
  cfg.data.train_files = 'data/text/train.bin'
  cfg.data.eval_files = 'data/text/eval.bin'
  cfg.data.tokens.dtype = 'uint16'
  return cfg

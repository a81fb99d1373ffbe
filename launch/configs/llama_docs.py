"""Example 1: a tiny Llama trained from JSON-lines documents with a tokenizer trained here.

  disttrain convert --source=text --format=jsonl --eval_documents=8 --out=data/docs
  disttrain tokenizer --input=data/docs/train.jsonl --vocab_size=2048 \
      --out=data/docs/tokenizer.json
  python launch/train.py --config=launch/configs/llama_docs.py --workdir=runs/llama_docs \
      --fake_devices=8

The documents are the Python standard library's modules (one per file), tokenized once at start-up
by a byte-level BPE tokenizer trained on them, packed whole into rows of 256 tokens by best fit
(segment ids keep each document's attention to itself), on 8 devices as fsdp 4 x tensor 2. The
run ends by printing a greedy sample (get_callbacks).
"""

import importlib.util
import os

_LLAMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama.py')


def get_config():
  spec = importlib.util.spec_from_file_location('llama_config', _LLAMA)
  llama = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(llama)
  cfg = llama.get_config('tiny')
  cfg.model.vocab_size = 2048
  cfg.data.name = 'documents'
  cfg.data.train_files = 'data/docs/train.jsonl'
  cfg.data.eval_files = 'data/docs/eval.jsonl'
  cfg.data.tokenizer = 'data/docs/tokenizer.json'
  cfg.data.packing = 'documents'
  cfg.data.seq_len = 256
  cfg.global_batch_size = 16
  cfg.eval_batch_size = 32
  cfg.num_train_steps = 200
  cfg.learning_rate = 3e-3
  cfg.grad_clip_norm = 1.0
  cfg.lr_schedule = 'cosine'
  cfg.min_lr_ratio = 0.1
  cfg.log_every_steps = 25
  cfg.eval_every_steps = 100
  cfg.checkpoint_every_steps = 100
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 4, 2
  return cfg


def get_callbacks(config):
  from disttrain.hf.generate import SampleAtEnd  # pylint: disable=g-import-not-at-top
  return [SampleAtEnd(config, ['def main(argv):\n    '])]

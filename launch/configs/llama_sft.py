'''Example 2: fine-tune example 1's model, exported to and imported from Hugging Face's format,
on prompt/completion pairs whose prompts carry no loss, then sample.

  disttrain export --workdir=runs/llama_docs --out=runs/llama_docs/hf
  disttrain convert --source=docstrings --format=jsonl --eval_documents=64 --out=data/sft
  python launch/train.py --config=launch/configs/llama_sft.py --workdir=runs/llama_sft \
      --fake_devices=8
  disttrain generate --workdir=runs/llama_sft --fake_devices=8 \
      --prompt=$'def read_config(path):\n    """'

The pairs are the standard library's documented functions: the prompt is a signature and the
opening quotes, the completion the first line of the docstring. `restore_from` a Hugging Face
directory checks its config.json against these model fields and places each tensor on its
shard; the loss is the mean over completion tokens only (data.name='sft': loss_mask).
'''

import importlib.util
import os

_DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama_docs.py')


def get_config():
  spec = importlib.util.spec_from_file_location('llama_docs_config', _DOCS)
  docs = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(docs)
  cfg = docs.get_config()
  cfg.restore_from = 'runs/llama_docs/hf'
  cfg.data.name = 'sft'
  cfg.data.train_files = 'data/sft/train.jsonl'
  cfg.data.eval_files = 'data/sft/eval.jsonl'
  cfg.data.seq_len = 128
  cfg.global_batch_size = 32
  cfg.num_train_steps = 150
  cfg.learning_rate = 1e-3
  cfg.warmup_steps = 10
  cfg.eval_every_steps = 50
  cfg.checkpoint_every_steps = 50
  return cfg


def get_callbacks(config):
  from disttrain.hf.generate import SampleAtEnd  # pylint: disable=g-import-not-at-top
  return [SampleAtEnd(config, ['def read_config(path):\n    """', 'def is_empty(self):\n    """'])]

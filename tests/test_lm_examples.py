"""The two language-model examples of docs/language-models.md, command by command, in a fresh
folder (each run 4 logged steps of 8 rows instead of the docs' 200 and 150: every step logged, so
one train step compiles per run): pretraining a tiny Llama from JSON-lines documents with a
tokenizer trained here, then exporting it to Hugging Face's format, importing it back to fine-tune
on prompt/completion pairs, and sampling (each run prints samples at its end; the generate command
itself is tested in tests/test_generate.py)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env


def _run(cwd, *args: str) -> str:
  env = subprocess_env()
  proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.slow
def test_pretrain_export_import_finetune_and_sample(tmp_path):
  train, configs = str(ROOT / 'launch' / 'train.py'), ROOT / 'launch' / 'configs'
  short = ['--fake_devices=8', '--config.num_train_steps=4', '--config.eval_every_steps=4',
           '--config.checkpoint_every_steps=4', '--config.log_every_steps=1',
           '--config.global_batch_size=8']
  _run(tmp_path, '-m', 'disttrain', 'convert', '--source=text', '--format=jsonl',
       '--eval_documents=8', '--out=data/docs')
  _run(tmp_path, '-m', 'disttrain', 'tokenizer', '--input=data/docs/train.jsonl',
       '--vocab_size=2048', '--out=data/docs/tokenizer.json')
  out = _run(tmp_path, train, f'--config={configs / "llama_docs.py"}', '--workdir=runs/llama_docs',
             *short)
  mesh = "mesh {'data': 1, 'stage': 1, 'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 2}"
  assert mesh in out and 'sample: ' in out
  assert 'perplexity' in [l for l in out.splitlines() if l.startswith('done:')][0]
  out = _run(tmp_path, '-m', 'disttrain', 'export', '--workdir=runs/llama_docs',
             '--out=runs/llama_docs/hf')
  assert 'LlamaForCausalLM' in out
  assert os.path.isfile(tmp_path / 'runs/llama_docs/hf/tokenizer.json')
  _run(tmp_path, '-m', 'disttrain', 'convert', '--source=docstrings', '--format=jsonl',
       '--eval_documents=64', '--out=data/sft')
  out = _run(tmp_path, train, f'--config={configs / "llama_sft.py"}', '--workdir=runs/llama_sft',
             *short)
  assert 'warm start: params from the Hugging Face model in runs/llama_docs/hf' in out
  assert out.count('sample: ') == 2
  records = [json.loads(l) for l in open(tmp_path / 'runs/llama_sft/metrics.jsonl')]
  train_losses = [r['loss'] for r in records if r['split'] == 'train']
  assert train_losses[-1] < train_losses[0]
  # docs/post-training.md's LoRA run: its samples read the base merged with the adapters (they
  # read the adapters alone as the model's parameters: exit 2 after training).
  out = _run(tmp_path, train, f'--config={configs / "llama_sft.py"}', '--workdir=runs/llama_lora',
             *short, '--config.lora.rank=16', '--config.lora.alpha=32')
  assert out.count('sample: ') == 2 and 'adapters' in out, out[-2000:]

"""What every Hugging Face family's test checks once its import equals transformers: the family
launch/configs/hf.py resolves the directory to, export -> transformers (1e-5) -> a second
import bitwise, and greedy decoding from the KV cache against transformers' `generate`.
"""

import jax
import numpy as np
import torch
import transformers

import disttrain
from disttrain import models
from disttrain.hf import config as hf_config, saves, trained
from tests import helpers
from tests.conftest import ROOT

def load(path: str):
  """The directory as `generate --hf_dir` loads it, on one device in float32."""
  return trained.load(hf_dir=path, devices=jax.devices()[:1], mesh={'data': 1},
                      compute_dtype='float32')


def reference(path: str):
  return transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation='eager').eval()


def from_directory(path: str, tmp_path) -> str:
  """The family launch/configs/hf.py resolves restore_from=path to, no model field given."""
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'hf.py')
  cfg = disttrain.from_config_dict(helpers.override(cd, {
      'restore_from': path, 'data.train_files': str(tmp_path / 'chat.jsonl')}))
  resolved = hf_config.from_directory(cfg)
  models.build(resolved.model, 'float32', 16)  # builds
  return resolved.model.name


def assert_exports_reimports_and_decodes(lm, path: str, tmp_path, tokens, ours, prompts):
  """Exported, transformers' logits on `tokens` equal `ours` to 1e-5 and a second import is
  bitwise `lm`'s; 16 greedy tokens per prompt equal transformers' `generate` on `path`."""
  out = str(tmp_path / 'exported')
  saves.write(out, lm.model.family, lm.cfg.model, lm.model.cfg, lm.params, lm.tokenizer, 64)
  with torch.no_grad():
    again = reference(out)(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(again[..., :ours.shape[-1]], ours, rtol=1e-5, atol=1e-5)
  second = load(out)
  assert second.cfg.model == lm.cfg.model  # the export's config.json reads back as the model
  for a, b in zip(jax.tree.leaves(helpers.to_numpy(lm.params)),
                  jax.tree.leaves(helpers.to_numpy(second.params)), strict=True):
    np.testing.assert_array_equal(a, b)
  generated = disttrain.generate(lm.model, lm.params, prompts, max_new_tokens=16, eos_id=None,
                                 mesh=lm.mesh, context=64)
  model = reference(path)
  for prompt, new in zip(prompts, generated.tokens):
    with torch.no_grad():
      want = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    assert list(new) == want[0, len(prompt):].tolist(), (lm.model.family, prompt)

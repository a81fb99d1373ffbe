"""Gemma 2 and Gemma 3 text models (disttrain/models/gemma.py) against `transformers`.

Random tiny models built by transformers and saved with save_pretrained here: 4 layers, local
(a window of 4 in 16-token rows) and global layers alternating, a head size of 24 apart from the
width, query_pre_attn_scalar 20, random (1 + w) norm scales; Gemma 2 with attention and final
logit caps small enough to bite (1.0 and 0.5) and linear rope scaling (factor 2), Gemma 3 with its
per-head query/key norms, the global layers' linear rope scaling on a base of its own and an
attention cap in config.json that transformers' Gemma 3 ignores (so must the import).
Imported logits equal transformers' eager float32 forward to 1e-4 (measured ~6e-7), and the layer
pattern matters (every layer global gives other logits); exported again, transformers' logits
equal ours to 1e-5, a second import is bitwise the first; greedy decoding from the KV cache gives
transformers' `generate` tokens for 16 new tokens from 2 prompts of different lengths. On
data x fsdp x tensor (both), and with the positions split over `context` (Gemma 3), one step
equals 1 device.
"""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from disttrain import models
from disttrain.config import ModelConfig, RopeScalingConfig
from disttrain.errors import CheckpointError, ConfigError
from disttrain.hf import config as hf_config, exported_config, gemma_config
from disttrain.models.decoder import Decoder
from tests import hf_round_trip, test_llama
from tests.helpers import assert_trees_close

VOCAB = 101


def _save(tmp_path, family: str) -> str:
  torch.manual_seed(11)
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=20,
                attn_implementation='eager')
  if family == 'gemma2':
    config = transformers.Gemma2Config(attn_logit_softcapping=1.0, final_logit_softcapping=0.5,
                                       rope_parameters={'rope_type': 'linear', 'factor': 2.0,
                                                        'rope_theta': 1e4}, **common)
  else:
    # An attention cap in config.json, which transformers' Gemma 3 does not apply: neither here.
    config = transformers.Gemma3TextConfig(
        sliding_window_pattern=2, attn_logit_softcapping=1.0, rope_parameters={
            'full_attention': {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 1e6},
            'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}, **common)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:
        p.copy_(torch.randn_like(p) * 0.5)
      if 'q_proj' in name or 'k_proj' in name:  # scores of a few units: the cap of 1.0 bites
        p.mul_(8.0)
  path = str(tmp_path / family)
  model.save_pretrained(path)
  return path


def _logits(model, params, tokens) -> np.ndarray:
  out = model.module.apply({'params': params}, jnp.asarray(tokens), False)
  return np.asarray(out)[..., :VOCAB]


@pytest.mark.slow  # two transformers models, a compile each for forward and decoding
@pytest.mark.parametrize('family', ['gemma2', 'gemma3'])
def test_gemma_imports_exports_and_decodes_as_transformers(tmp_path, family):
  path = _save(tmp_path, family)
  lm = hf_round_trip.load(path)
  assert hf_round_trip.from_directory(path, tmp_path) == lm.cfg.model.name  # launch/configs/hf.py: no field
  assert lm.model.family == family and lm.model.cfg.layer_windows == (4, 0, 4, 0)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
  reference = hf_round_trip.reference(path)
  with torch.no_grad():
    want = reference(torch.tensor(tokens)).logits.numpy()
  ours = _logits(lm.model, lm.params, tokens)
  np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)
  every_layer_global = dataclasses.replace(lm.model, module=Decoder(dataclasses.replace(
      lm.model.cfg, layer_windows=(), sliding_window=0)))
  assert np.abs(_logits(every_layer_global, lm.params, tokens) - want).max() > 1e-3
  # Gemma 2 caps its attention scores (transformers' Gemma 3 does not, whatever config.json says).
  other_cap = dataclasses.replace(lm.model, module=Decoder(dataclasses.replace(
      lm.model.cfg, attn_softcap=0.0 if family == 'gemma2' else 1.0)))
  assert np.abs(_logits(other_cap, lm.params, tokens) - want).max() > 1e-3

  hf_round_trip.assert_exports_reimports_and_decodes(
      lm, path, tmp_path, tokens, ours, [[5, 17, 3, 99, 42], [8, 1, 64, 23, 7, 90, 11, 2, 36]])


GEMMA3 = {'model.name': 'gemma3', 'model.head_dim': 24, 'model.sliding_window': 8,
          'model.sliding_window_pattern': 2, 'model.local_rope_theta': 10_000.0,
          'model.query_pre_attn_scalar': 20.0, 'model.tied_embeddings': True}
GEMMA2 = {**GEMMA3, 'model.name': 'gemma2', 'model.local_rope_theta': 0.0,
          'model.attn_softcap': 1.0, 'model.final_softcap': 0.5, 'model.attention': 'xla'}
CUBE = {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2}
CONTEXT = {'mesh.data': 2, 'mesh.context': 2, 'mesh.tensor': 2}


@pytest.mark.slow
# Gemma 3 on data x context x tensor, Gemma 2 (the same decoder, capped) on data x fsdp x tensor:
# every split of the family's weights and sequence between them.
@pytest.mark.parametrize('fields,layout', [(GEMMA3, CONTEXT), (GEMMA2, CUBE)],
                         ids=['gemma3_data_context_tensor', 'gemma2_data_fsdp_tensor'])
def test_gemma_one_step_on_eight_devices_equals_one(fields, layout):
  """The per-layer windows and rotary bases are scanned values: they split like the rest, and
  under the context split the window masks the all-gathered keys (32-token rows, a window of 8);
  Gemma 2's capped attention (its own dense form) splits its heads over tensor."""
  ref_loss, ref_grads = test_llama._one_step(test_llama._config(**test_llama.ONE, **fields), 1)
  loss, grads = test_llama._one_step(test_llama._config(**layout, **fields), 8)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(grads, ref_grads, 1e-5, 1e-6, f'{fields["model.name"]} on {layout}')


def test_gemma3_local_rope_scaling_is_refused(tmp_path):
  """Local layers rotate unscaled here: a config.json scaling them is one line, not other logits."""
  config = transformers.Gemma3TextConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
      sliding_window_pattern=2,
      rope_parameters={'full_attention': {'rope_type': 'default', 'rope_theta': 1e6},
                       'sliding_attention': {'rope_type': 'linear', 'factor': 4.0,
                                             'rope_theta': 1e4}})
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / 'g3')
  with pytest.raises(CheckpointError, match="sliding_attention rope_type 'linear'"):
    hf_round_trip.load(str(tmp_path / 'g3'))


@pytest.mark.parametrize('fields', [
    {'local_rope_theta': 0.0, 'rope_scaling': RopeScalingConfig(kind='linear', factor=8.0)},
    {'local_rope_theta': 1e4, 'rope_scaling': RopeScalingConfig(kind='llama3', factor=8.0,
                                                               original_max_len=16)},
    {'local_rope_theta': 1e4, 'sliding_window_pattern': 0},
    {'local_rope_theta': 1e3},
    # No window: transformers' Gemma builds the windowed mask all the same (sliding_window null
    # was a ValueError at its forward); every layer full_attention reads back as no window.
    {'local_rope_theta': 1e4, 'sliding_window': 0, 'sliding_window_pattern': 0}],
    ids=['linear_local_0', 'llama3', 'every_layer_local', 'local_base_is_global', 'no_window'])
def test_gemma3_exports_the_rotation_its_layers_were_built_with(tmp_path, fields):
  """A run's Gemma 3 written for transformers: local layers scaled as the global ones (local 0),
  llama3 scaling, every layer windowed on the global base. The export wrote the local layers
  unscaled, dropped llama3 and gave pattern 0 the local base: logits 0.8-4.4 off transformers'."""
  import jax  # pylint: disable=g-import-not-at-top
  from disttrain.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from disttrain.hf import saves  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(**{**dict(
      name='gemma3', hidden=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
      mlp_dim=48, vocab_size=VOCAB, tied_embeddings=True, norm_eps=1e-6, rope_theta=1e3,
      sliding_window=6, sliding_window_pattern=2, query_pre_attn_scalar=16.0), **fields})
  model = models.build(cfg, 'float32', 40)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (1, 40))
  params = model.init(jax.random.key(0), {'tokens': jnp.zeros((1, 40), jnp.int32)})['params']
  params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape), params)
  exported_config.check_exportable(model, 'run')
  saves.write(str(tmp_path), 'gemma3', cfg, model.cfg, params, tokenizer_lib.load(''), 64)
  reference = hf_round_trip.reference(str(tmp_path))
  with torch.no_grad():
    want = reference(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(_logits(model, params, tokens), want, rtol=1e-4, atol=1e-4)
  if fields.get('local_rope_theta') == 0.0:  # the export reads back as the run's model
    assert hf_round_trip.load(str(tmp_path)).cfg.model.local_rope_theta == 0.0
  if 'sliding_window' in fields:
    assert hf_round_trip.load(str(tmp_path)).cfg.model.sliding_window == 0
  hf_config.check(str(tmp_path), 'gemma3', cfg, model.cfg)  # the run restores its own export


@pytest.mark.parametrize('name,field', [('gpt', 'sliding_window'), ('llama', 'attn_softcap'),
                                        ('llama', 'final_softcap'),
                                        ('qwen3', 'query_pre_attn_scalar'),
                                        ('mistral', 'sliding_window_pattern'),
                                        ('gemma2', 'local_rope_theta')])
def test_a_field_the_family_does_not_build_is_refused(name, field):
  """Each was dropped: the logits equalled the default config's (a review, max diff 0.0)."""
  cfg = ModelConfig(name=name, hidden=32, num_layers=1, num_heads=2, vocab_size=64, **{field: 2})
  with pytest.raises(ConfigError, match=f"model.{field}=2: model.name='{name}' does not build "
                                        'it'):
    models.build(cfg)
  models.build(dataclasses.replace(cfg, name='gemma3'))  # a family that builds it


@pytest.mark.parametrize('name,fields,message', [
    ('gpt', {'head_dim': 8}, 'model.head_dim=8: the GPT family has learned positions and heads '
                             'of hidden / num_heads = 16'),  # it built 16-wide heads
    ('gpt', {'rope_theta': 500.0}, 'model.rope_theta=500.0: the GPT family'),  # no rotation
    ('gpt', {'rope_scaling': RopeScalingConfig(kind='linear', factor=2.0)},
     "model.rope_scaling.kind='linear': the GPT family"),
    ('gemma2', {'norm': 'layernorm'}, "model.norm='layernorm': the Gemma family uses its "
                                      'RMSNorm'),  # it built Gemma's offset RMSNorm
])
def test_fields_a_family_builds_otherwise_are_refused(name, fields, message):
  cfg = ModelConfig(name=name, hidden=32, num_layers=1, num_heads=2, vocab_size=64, **fields)
  with pytest.raises(ConfigError, match=re.escape(message)):
    models.build(cfg)
  models.build(dataclasses.replace(cfg, name='llama', norm=''))  # a family that builds them


def test_layer_patterns_read_and_written_as_transformers_lists_them():
  """layer_types as transformers' config classes list them: 8 layers at Gemma 3's published
  pattern 6 (layer 6 global), 4 layers at it (all local: not refused), Gemma 2's alternation; and
  a window with pattern 0 (every layer local here) exported as all sliding_attention."""
  small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, sliding_window=4)
  for family, make, layers_ in (('gemma3', transformers.Gemma3TextConfig, 8),
                                ('gemma3', transformers.Gemma3TextConfig, 4),
                                ('gemma2', transformers.Gemma2Config, 4)):
    hf = make(num_hidden_layers=layers_, **small).to_dict()
    fields = hf_config.model_fields(hf, family)
    assert gemma_config.layer_types(fields['sliding_window_pattern'], 4, layers_) == \
        hf['layer_types'], (family, layers_)
  cfg = ModelConfig(name='gemma3', hidden=32, num_layers=3, num_heads=2, num_kv_heads=1,
                    head_dim=16, mlp_dim=48, vocab_size=VOCAB, sliding_window=4,
                    sliding_window_pattern=0)
  model = models.build(cfg, 'float32', 16)
  out = exported_config.for_export('gemma3', cfg, model.cfg, 'float32', {})
  assert out['layer_types'] == ['sliding_attention'] * 3 and out['sliding_window'] == 4
  assert hf_config.model_fields(out, 'gemma3')['sliding_window'] == 4

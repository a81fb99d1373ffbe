"""Hugging Face weights in and out, against the reference implementation (`transformers`).

Random tiny LlamaForCausalLM (1, 2 and 4 K/V heads, tied and untied), Qwen2ForCausalLM and
Qwen3ForCausalLM (random biases and norm scales) and GPT2LMHeadModel are built from a config and
saved with save_pretrained here. Imported into disttrain, their logits
equal transformers' forward pass to 1e-4 (float32; measured <= 3e-7); exported from a disttrain
run, transformers' logits equal ours to 1e-5 (measured <= 2e-6); import -> export -> import is
bitwise.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import disttrain
from disttrain import models
from disttrain.config import ModelConfig, RopeScalingConfig
from disttrain.errors import CheckpointError, ConfigError
from disttrain.hf import config as hf_config, exported_config, tensorfiles, trained, weights as hf
from disttrain.launch import config_args
from disttrain.models import layers
from tests import helpers, hf_round_trip
from tests.conftest import ROOT, subprocess_env

VOCAB = 99
LLAMAS = [(1, False), (2, True), (4, False)]  # (K/V heads, tied embeddings)


def _llama(tmp_path, kv: int, tied: bool, **overrides) -> str:
  torch.manual_seed(kv)
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64,
      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, **overrides)
  path = str(tmp_path / f'llama_{kv}_{tied}')
  transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
  return path


def _gpt2(tmp_path, config_fields=None, **save) -> str:
  torch.manual_seed(0)
  config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                   n_positions=32, bos_token_id=0, eos_token_id=0,
                                   **(config_fields or {}))
  path = str(tmp_path / 'gpt2')
  transformers.GPT2LMHeadModel(config).eval().save_pretrained(path, **save)
  return path


def _model_config(name: str, kv: int = 0, tied: bool = True, **fields) -> ModelConfig:
  extra = dict(num_kv_heads=kv, mlp_dim=96) if name != 'gpt' else dict(max_seq_len=32)
  return ModelConfig(name=name, hidden=64, num_layers=2, num_heads=4, vocab_size=VOCAB,
                     tied_embeddings=tied, dropout=0.0, **extra, **fields)


def _load(path: str, cfg: ModelConfig):
  """(model, params) restored from a Hugging Face directory on one device."""
  model = models.build(cfg, 'float32', 16)
  mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             {'tokens': jnp.zeros((1, 16), jnp.int32)}))['params']
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                          shapes)
  return model, hf.restore(path, model, cfg, abstract)


def _reference_logits(path: str, tokens: np.ndarray) -> np.ndarray:
  model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def _our_logits(model, params, tokens) -> np.ndarray:
  return np.asarray(model.module.apply({'params': params}, jnp.asarray(tokens), False))[..., :VOCAB]


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 16))


@pytest.mark.parametrize('kv,tied', LLAMAS)
def test_imported_llama_logits_equal_transformers(tmp_path, kv, tied):
  path = _llama(tmp_path, kv, tied)
  model, params = _load(path, _model_config('llama', kv, tied))
  np.testing.assert_allclose(_our_logits(model, params, TOKENS),
                             _reference_logits(path, TOKENS), rtol=1e-4, atol=1e-4)


def _qwen(tmp_path, family: str, tied: bool, vocab: int = VOCAB) -> str:
  """Qwen2: biases on q, k, v; Qwen3: per-head query and key norms, head_dim 24 apart from the
  width's 64 / 4 heads. Random norm scales and biases, so a missing one shows in the logits."""
  torch.manual_seed(3)
  kind = transformers.Qwen2Config if family == 'qwen2' else transformers.Qwen3Config
  config = kind(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=tied,
                **({'head_dim': 24} if family == 'qwen3' else {}))
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(('norm.weight', 'bias')):
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith('weight') else 0.0))
  path = str(tmp_path / family)
  model.save_pretrained(path)
  return path


@pytest.mark.parametrize('family,tied', [('qwen2', False), ('qwen3', True)])
def test_imported_qwen_logits_equal_transformers(tmp_path, family, tied):
  path = _qwen(tmp_path, family, tied)
  model, params = _load(path, _model_config(family, 2, tied, norm_eps=1e-6, rope_theta=1e6,
                                            head_dim=24 if family == 'qwen3' else 0))
  np.testing.assert_allclose(_our_logits(model, params, TOKENS),
                             _reference_logits(path, TOKENS), rtol=1e-4, atol=1e-4)


def _mistral(tmp_path) -> str:
  torch.manual_seed(5)
  config = transformers.MistralConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4, tie_word_embeddings=False)
  path = str(tmp_path / 'mistral')
  transformers.MistralForCausalLM(config).eval().save_pretrained(path)
  return path


def test_imported_mistral_with_a_sliding_window_equals_transformers(tmp_path):
  """A window of 4 positions in 16-token rows (transformers masks the same: its sliding-window
  causal mask); the cached decoding of the same model is tests/test_generate.py's."""
  path = _mistral(tmp_path)
  model, params = _load(path, _model_config('mistral', 2, False, sliding_window=4))
  reference = _reference_logits(path, TOKENS)
  np.testing.assert_allclose(_our_logits(model, params, TOKENS), reference, rtol=1e-4, atol=1e-4)
  # The window matters here: the same weights attending to every position give other logits.
  whole = _our_logits(models.build(_model_config('mistral', 2, False), 'float32', 16), params,
                      TOKENS)
  assert np.abs(whole - reference).max() > 1e-2


@pytest.mark.slow
def test_hf_config_trains_the_model_its_directory_describes(tmp_path):
  """launch/configs/hf.py with restore_from alone: the family and every model field come from
  config.json (the logits then equal transformers'), a field set to another value is one line,
  and a one-step run records the resolved model in run.json and starts from the weights."""
  path = _qwen(tmp_path, 'qwen3', True, vocab=300)  # bytes (end of sequence 256) fit
  rows = tmp_path / 'sft.jsonl'
  rows.write_text(''.join(json.dumps({'prompt': f'q{i}?', 'completion': f' a{i}.'}) + '\n'
                          for i in range(24)))
  base = {'restore_from': path, 'data.train_files': str(rows), 'data.eval_examples': 8,
          'data.seq_len': 16, 'global_batch_size': 8, 'eval_batch_size': 8, 'mesh.data': 1,
          'precision.compute_dtype': 'float32', 'num_train_steps': 1, 'log_every_steps': 1}

  def config(**overrides):
    cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'hf.py')
    return disttrain.from_config_dict(helpers.override(cd, {**base, **overrides}))

  resolved = hf_config.from_directory(config(**{'model.head_dim': 24}))  # agrees: kept
  model = resolved.model
  assert (model.name, model.hidden, model.num_layers, model.num_heads, model.num_kv_heads,
          model.head_dim, model.mlp_dim, model.vocab_size, model.tied_embeddings) == (
              'qwen3', 64, 2, 4, 2, 24, 96, 300, True)
  assert (model.rope_theta, model.norm_eps, model.dropout) == (1e6, 1e-6, 0.0)
  ours, params = _load(path, model)
  np.testing.assert_allclose(_our_logits(ours, params, TOKENS),
                             _reference_logits(path, TOKENS)[..., :VOCAB], rtol=1e-4, atol=1e-4)
  with pytest.raises(ConfigError, match='config.json gives model.num_layers=2 but the config '
                                        'sets model.num_layers=3; drop --config.model.num_layers'):
    hf_config.from_directory(config(**{'model.num_layers': 3}))
  # Set to ModelConfig's default (1e-5) it was taken as unset: the launcher names what its
  # command line set, and those must agree too.
  named = config_args.model_fields(['--config.model.norm_eps=1e-5', '--config.data.seq_len=16',
                                    '--config.model.rope_scaling.kind=', '--config=hf.py'])
  assert named == {'norm_eps', 'rope_scaling'}
  with pytest.raises(ConfigError, match='config.json gives model.norm_eps=1e-06 but the config '
                                        'sets model.norm_eps=1e-05'):
    hf_config.refuse_contradictions(config(**{'model.norm_eps': 1e-5}), named)
  hf_config.refuse_contradictions(config(**{'model.head_dim': 24}), {'head_dim', 'rope_scaling'})
  # A scaling config.json does not have (it trained another model, 4.6 off transformers).
  with pytest.raises(ConfigError, match=r"config.json gives model.rope_scaling=\{'kind': ''"):
    hf_config.from_directory(config(**{'model.rope_scaling.kind': 'linear'}))
  linear = dataclasses.replace(model, rope_scaling=RopeScalingConfig(kind='linear', factor=4.0))
  with pytest.raises(CheckpointError, match="config.json rope_scaling.rope_type='' but "
                                            "model.rope_scaling.kind='linear'"):
    hf_config.check(path, 'qwen3', linear, ours.cfg)
  with pytest.raises(ConfigError, match="set --config.restore_from=HF_DIR"):
    hf_config.from_directory(config(restore_from=''))
  result = disttrain.train(config(), str(tmp_path / 'run'), devices=jax.devices()[:1])
  info = json.loads((tmp_path / 'run' / 'run.json').read_text())
  assert info['config']['model']['name'] == 'qwen3' and info['config']['model']['head_dim'] == 24
  assert result.step == 1 and np.isfinite(result.records[0]['loss'])


@pytest.mark.parametrize('tied', [True, False])
def test_imported_gpt2_logits_equal_transformers_from_sharded_files(tmp_path, tied):
  # An epsilon of its own (untied): GPT-2's small initial activations make it show in the logits.
  eps = {} if tied else {'layer_norm_epsilon': 1e-2}
  path = _gpt2(tmp_path, {'tie_word_embeddings': tied, **eps},
               max_shard_size='100KB')  # model-0000i-of-0000N + an index
  assert os.path.isfile(os.path.join(path, tensorfiles.INDEX))
  assert hf_config.model_fields(hf_config.read(path)[0], 'gpt')['norm_eps'] == (
      1e-5 if tied else 1e-2)
  model, params = _load(path, _model_config('gpt', tied=tied, norm_eps=1e-5 if tied else 1e-2))
  np.testing.assert_allclose(_our_logits(model, params, TOKENS),
                             _reference_logits(path, TOKENS), rtol=1e-4, atol=1e-4)
  if not tied:  # its own lm_head, exported back under its name
    names = [name for name, *_ in hf.export_tensors('gpt', model.cfg, params, np.float32)]
    assert 'lm_head.weight' in names and 'transformer.wte.weight' in names


def test_keys_a_config_json_leaves_out_are_transformers_defaults():
  """A config.json without its norm epsilon, rotary base, window or caps describes the model
  transformers' config class fills in (Mixtral's 1e-5 and 1e6, Mistral's window of 4096, Gemma
  2's caps of 50 and 30, Mixtral's 8 experts, 2 a token, Gemma's tied embeddings, ...): the
  model fields read from it equal those of the full dict."""
  small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
  left_out = ('rms_norm_eps', 'rope_theta', 'rope_parameters', 'rope_scaling', 'sliding_window',
              'attn_logit_softcapping', 'final_logit_softcapping', 'rope_local_base_freq',
              'num_local_experts', 'num_experts', 'num_experts_per_tok', 'norm_topk_prob',
              'tie_word_embeddings')
  for arch, family in hf_config.ARCHITECTURES.items():
    if family == 'gpt':
      continue
    config_class = transformers.AutoConfig.for_model(
        {'gemma3': 'gemma3_text'}.get(family, family)).__class__
    full = config_class(**small).to_dict()
    full['architectures'] = [arch]
    sparse = {k: v for k, v in full.items() if k not in left_out}
    assert hf_config.model_fields(sparse, family) == hf_config.model_fields(full, family), family


def test_exports_no_hugging_face_model_builds_are_refused():
  """What the family's transformers model would compute otherwise: a window on a family
  without one, RMSNorm in GPT-2, an attention cap in Gemma 3 (transformers applies none),
  unnormalised top-k gates in Mixtral (transformers always renormalises), a fractional Gemma
  query_pre_attn_scalar."""
  cases = [(_model_config('llama', 2, sliding_window=8), 'model.sliding_window=8'),
           (_model_config('qwen3', 2, sliding_window=8), 'the qwen3 Hugging Face model'),
           (_model_config('gpt', norm='rmsnorm'), "model.norm='rmsnorm'"),
           (_model_config('gemma3', 2, head_dim=16, attn_softcap=50.0),
            'model.attn_softcap=50.0'),
           (_model_config('mixtral', 2, num_experts=4, experts_per_token=2, moe_norm_topk=False),
            'model.moe_norm_topk=False'),
           # transformers' Gemma holds an integer: 20.5 was written as 20 (logits 3e-2 off)
           (_model_config('gemma2', 2, head_dim=16, query_pre_attn_scalar=20.5),
            'model.query_pre_attn_scalar=20.5')]
  for cfg, message in cases:
    with pytest.raises(ConfigError, match=re.escape(message)):
      exported_config.check_exportable(models.build(cfg, 'float32', 16), 'the run')
  exported_config.check_exportable(models.build(_model_config('mistral', 2, sliding_window=8),
                                                'float32', 16), 'the run')


def test_gpt2_attention_scalings_it_does_not_build_are_refused(tmp_path):
  for field, value in (('scale_attn_by_inverse_layer_idx', True), ('scale_attn_weights', False)):
    path = _gpt2(tmp_path / field, {field: value})
    with pytest.raises(CheckpointError, match=f'{field}={value}'):
      _load(path, _model_config('gpt'))


def test_llama3_rope_scaling_equals_transformers():
  config = transformers.LlamaConfig(
      hidden_size=2048, num_attention_heads=32, rope_theta=500_000.0,
      rope_scaling={'rope_type': 'llama3', 'factor': 32.0, 'low_freq_factor': 1.0,
                    'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192})
  rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
  ours = layers.rope_frequencies(64, 500_000.0, layers.RopeScaling('llama3', 32.0, 1.0, 4.0, 8192))
  np.testing.assert_allclose(ours, rotary.inv_freq.numpy(), rtol=1e-6)


LLAMA3 = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
          'original_max_position_embeddings': 16}


def test_llama3_scaled_rope_is_read_from_either_config_json_form(tmp_path):
  """transformers 5 saves rope_parameters; Llama 3.x's published config.json (and our export)
  has rope_theta and rope_scaling at the top: both read as the same scaling, equal logits."""
  path = _llama(tmp_path, 2, False, rope_scaling=LLAMA3)
  reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
  with torch.no_grad():
    for name, p in reference.named_parameters():
      if 'q_proj' in name or 'k_proj' in name:  # scores of a few units: the rotation shows
        p.mul_(8.0)
    want = reference(torch.tensor(TOKENS)).logits.numpy()
  reference.save_pretrained(path)
  config_file = os.path.join(path, 'config.json')
  saved = json.loads(open(config_file, encoding='utf-8').read())
  published = {k: v for k, v in saved.items() if k != 'rope_parameters'}
  published.update(rope_theta=10000.0, rope_scaling=LLAMA3)
  scaling = {'kind': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
             'original_max_len': 16}
  for form in (saved, published):
    with open(config_file, 'w', encoding='utf-8') as f:
      json.dump(form, f)
    lm = hf_round_trip.load(path)
    assert vars(lm.cfg.model.rope_scaling) == scaling, form.keys()
    np.testing.assert_allclose(_our_logits(lm.model, lm.params, TOKENS), want, rtol=1e-4,
                               atol=1e-4)


def _train_and_export(tmp_path, name: str, tied: bool, dtype: str = 'float32') -> tuple:
  """A 2-step disttrain run of a tiny model (byte text), exported; (run dir, HF dir). Qwen3
  runs launch/configs/llama.py with its name and a head_dim of 24 (64 / 4 heads would be 16)."""
  family_file = 'gpt' if name == 'gpt' else 'llama'
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / f'{family_file}.py')
  if name == 'qwen3':
    helpers.override(cd, {'model.name': 'qwen3', 'model.head_dim': 24})
  helpers.override(cd, {'model.num_layers': 2, 'model.hidden': 64, 'model.num_heads': 4,
                        'model.tied_embeddings': tied, 'num_train_steps': 2, 'mesh.data': 1,
                        'data.seq_len': 16, 'global_batch_size': 8, 'eval_batch_size': 8,
                        'data.text.bytes': 20_000, 'data.eval_examples': 8, 'model.vocab_size': 300,
                        'eval_every_steps': 0, 'log_every_steps': 1})  # one step compiles
  run, out = tmp_path / f'{name}_run', tmp_path / f'{name}_hf_{dtype}'
  disttrain.train(disttrain.from_config_dict(cd), str(run), devices=jax.devices()[:1])
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'export', f'--workdir={run}',
                         f'--out={out}', f'--dtype={dtype}'], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, check=False, env=_env())
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip().splitlines()[-1].startswith(f'exported {run} step 2')
  return run, out


def _env() -> dict:
  return subprocess_env()


@pytest.fixture(scope='module')
def llama_export(tmp_path_factory) -> tuple:
  """The untied Llama run and its float32 export: trained and exported once for the logits test
  and the bfloat16 test."""
  return _train_and_export(tmp_path_factory.mktemp('llama'), 'llama', False)


@pytest.mark.slow
# qwen3's export: test_dense_family_round_trips_and_decodes_as_transformers[qwen3] (the same
# saves.write that export calls, against transformers' logits).
@pytest.mark.parametrize('name,tied', [('llama', False), ('gpt', True)])
def test_exported_run_loads_in_transformers_with_equal_logits(request, tmp_path, name, tied):
  run, out = (request.getfixturevalue('llama_export') if name == 'llama' else
              _train_and_export(tmp_path, name, tied))
  lm = trained.load(workdir=str(run), devices=jax.devices()[:1], mesh={'data': 1})
  tokens = np.random.default_rng(1).integers(0, 300, (2, 16))
  ours = np.asarray(lm.model.module.apply({'params': lm.params}, jnp.asarray(tokens), False))
  np.testing.assert_allclose(_reference_logits(str(out), tokens), ours[..., :300], rtol=1e-5,
                             atol=1e-5)
  config = json.loads((out / 'config.json').read_text())
  assert config['architectures'] == [hf_config.FAMILIES[name]] and config['vocab_size'] == 300


@pytest.mark.slow
def test_bfloat16_export_is_the_rounded_float32(llama_export, tmp_path):
  run, out32 = llama_export
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'export', f'--workdir={run}',
                         f'--out={tmp_path / "bf16"}', '--dtype=bfloat16'], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  full, half = tensorfiles.Reader(str(out32)), tensorfiles.Reader(str(tmp_path / 'bf16'))
  assert full.names() == half.names()
  for name in full.names():
    assert half.read(name).dtype == jnp.bfloat16
    np.testing.assert_array_equal(half.read(name), full.read(name).astype(jnp.bfloat16))
  assert transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / 'bf16')).dtype == torch.bfloat16


@pytest.mark.parametrize('name', ['llama', 'gpt', 'qwen2'])
def test_import_export_import_is_bitwise(tmp_path, name):
  path = {'llama': lambda: _llama(tmp_path, 2, False), 'gpt': lambda: _gpt2(tmp_path),
          'qwen2': lambda: _qwen(tmp_path, 'qwen2', False)}[name]()
  cfg = {'llama': _model_config('llama', 2, False), 'gpt': _model_config('gpt'),
         'qwen2': _model_config('qwen2', 2, False, norm_eps=1e-6, rope_theta=1e6)}[name]
  model, params = _load(path, cfg)
  out = tmp_path / 'again'
  out.mkdir()
  tensorfiles.write(str(out), hf.export_tensors(name, model.cfg, params, np.float32))
  (out / 'config.json').write_text(open(os.path.join(path, 'config.json')).read())
  _, again = _load(str(out), cfg)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  original, exported = tensorfiles.Reader(path), tensorfiles.Reader(str(out))
  for tensor in exported.names():  # the same tensors as transformers wrote, bit for bit
    np.testing.assert_array_equal(exported.read(tensor), original.read(tensor))


def test_an_export_over_an_earlier_one_leaves_only_its_own_weights(tmp_path):
  """Sharded files, then one file, into the same directory (and back): the other layout's files
  stayed, and disttrain (index first) and transformers (model.safetensors first) read different
  models."""
  tensors = lambda value: [(f't{i}', (64,), np.float32, lambda: np.full(64, value, np.float32))
                           for i in range(4)]
  out = str(tmp_path)
  for value, shard_bytes in ((1.0, 300), (2.0, 2**30), (3.0, 300)):
    names = tensorfiles.write(out, tensors(value), max_shard_bytes=shard_bytes)
    assert sorted(os.listdir(out)) == sorted(names + ([tensorfiles.INDEX] if len(names) > 1
                                                      else [])), os.listdir(out)
    assert tensorfiles.Reader(out).read('t3')[0] == value


def test_bad_hugging_face_directories_are_one_line_errors(tmp_path):
  """Every damaged directory of LAUNCHER_CASES, and configs that contradict config.json, in
  process (the launcher cases check the exit status too)."""
  path = _llama(tmp_path, 2, True)
  cfg = _model_config('llama', 2, True)
  cases = [(case, cfg, message) for case, flags, message in LAUNCHER_CASES if not flags] + [
      ('', _model_config('llama', 2, True, norm_eps=1e-6),
       'config.json rms_norm_eps=1e-05 but model.norm_eps=1e-06'),
      ('', _model_config('llama', 4, True),
       'config.json num_key_value_heads=2 but model.num_kv_heads=4'),
      ('', _model_config('gpt'), "is a LlamaForCausalLM but model.name='gpt'"),
      ('', _model_config('llama', 2, False),
       'config.json tie_word_embeddings=True but model.tied_embeddings=False'),
      ('', _model_config('llama', 2, True, num_experts=4),
       'config.json describes a dense llama (no experts) but model.num_experts=4; set '
       '--config.model.num_experts=0')]
  for i, (case, config, message) in enumerate(cases):
    out = tmp_path / f'case{i}'
    _damaged(path, out, case)
    with pytest.raises((CheckpointError, ConfigError), match=re.escape(message)) as e:
      _load(str(out), config)
    assert '\n' not in str(e.value)
  # No architectures: the family from model_type, as AutoModelForCausalLM takes it (refused before).
  _damaged(path, tmp_path / 'no_architectures', 'no_architectures')
  assert hf_config.read(str(tmp_path / 'no_architectures'))[1] == 'llama'
  # transformers loads a tied model whose file holds lm_head.weight too (the head is the
  # embedding): it was refused as a tensor the config has no parameter for.
  _damaged(path, tmp_path / 'tied_head', 'tied_head')
  for a, b in zip(jax.tree.leaves(_load(str(tmp_path / 'tied_head'), cfg)[1]),
                  jax.tree.leaves(_load(path, cfg)[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _damaged(path: str, out, case: str) -> None:
  """A copy of the Hugging Face directory `path` in `out`, damaged as `case` says."""
  os.system(f'cp -r {path} {out}')
  reader = tensorfiles.Reader(path)
  tensors = {n: reader.read(n) for n in reader.names()}
  name = 'model.layers.1.mlp.up_proj.weight'
  if case == 'no_config':
    os.remove(out / 'config.json')
  elif case == 'no_weights':
    os.remove(out / 'model.safetensors')
  elif case == 'truncated':  # a download cut short: a numpy reshape error named no file
    with open(out / 'model.safetensors', 'r+b') as f:
      f.truncate(os.path.getsize(out / 'model.safetensors') - 1000)
  elif case == 'no_key':  # a hand-written config.json: a bare KeyError
    config = json.loads((out / 'config.json').read_text())
    del config['intermediate_size']
    (out / 'config.json').write_text(json.dumps(config))
  elif case == 'architecture':
    (out / 'config.json').write_text(json.dumps({'architectures': ['BertModel']}))
  elif case in ('model_type', 'no_architectures'):  # from_pretrained goes by model_type
    config = json.loads((out / 'config.json').read_text())
    if case == 'model_type':
      config['model_type'] = 'bert'
    else:
      del config['architectures']
    (out / 'config.json').write_text(json.dumps(config))
  elif case in ('missing_tensor', 'tensor_shape', 'memory', 'tied_head'):
    if case == 'missing_tensor':
      tensors.pop(name)
    elif case == 'tied_head':  # a tied model's save that writes the head too
      tensors['lm_head.weight'] = tensors['model.embed_tokens.weight']
    else:
      tensors[name] = tensors[name][:, :32]
    tensorfiles.write(str(out), [(k, v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()])


LAUNCHER_CASES = [
    ('architecture', [], "architectures ['BertModel'] are none of"),
    # A BERT's config.json with LlamaForCausalLM loaded as a Llama (transformers: a BertModel).
    ('model_type', [], "model_type 'bert' is not a LlamaForCausalLM's ('llama'); fix config"),
    ('no_config', [], 'config.json cannot be read'),
    ('no_weights', [], 'has no *.safetensors weights'),
    ('truncated', [], 'the file is truncated or corrupt, re-download or re-export it'),
    ('no_key', [], "config.json has no 'intermediate_size', which a LlamaForCausalLM needs"),
    ('field', ['--config.model.norm_eps=1e-6'],
     'config.json rms_norm_eps=1e-05 but model.norm_eps=1e-06; set --config.model.norm_eps=1e-05'),
    ('missing_tensor', [], 'has no tensor model.layers.1.mlp.up_proj.weight'),
    ('tensor_shape', [], 'tensor model.layers.1.mlp.up_proj.weight has shape (96, 32) but the '
     'config expects (96, 64)'),
    # The memory pre-flight comes before the weights are read (these are damaged too).
    ('memory', ['--config.memory_limit_bytes=1000000'], 'per device (state'),
]


# Through the launcher: one case per kind of failure (the directory's config, a tensor, a flag
# against config.json, the memory pre-flight); every message is checked in process above.
_THROUGH_LAUNCHER = ('missing_tensor', 'field', 'memory')


@pytest.mark.parametrize('case,flags,message', [
    pytest.param(*c, marks=pytest.mark.slow) for c in LAUNCHER_CASES
    if c[0] in _THROUGH_LAUNCHER], ids=list(_THROUGH_LAUNCHER))
def test_bad_hugging_face_directory_through_the_launcher(tmp_path, case, flags, message):
  """restore_from a damaged directory: one `error:` line, exit 2, before any step."""
  _damaged(_llama(tmp_path, 2, True), tmp_path / case, case)
  proc = subprocess.run(
      [sys.executable, 'launch/train.py', '--config=launch/configs/llama.py',
       f'--workdir={tmp_path / "run"}', '--fake_devices=1',
       f'--config.restore_from={tmp_path / case}',
       '--config.num_train_steps=1', '--config.model.hidden=64', '--config.model.num_layers=2',
       '--config.model.num_heads=4', '--config.model.num_kv_heads=2',
       '--config.model.mlp_dim=96', f'--config.model.vocab_size={VOCAB}',
       '--config.data.seq_len=16', '--config.global_batch_size=8', '--config.eval_batch_size=8',
       '--config.data.text.bytes=20000', *flags],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
  assert errors[0].startswith('error: ') and message in errors[0], errors[0]
  assert not os.path.isdir(tmp_path / 'run' / 'checkpoints' / '1')


PUBLISHED = {('llama', 'smollm2_135m'): 134_515_008, ('llama', 'llama3_1b'): 1_235_814_400,
             ('qwen', 'qwen2_5_0_5b'): 494_032_768, ('qwen', 'qwen3_0_6b'): 596_049_920,
             ('mistral', 'mistral_7b'): 7_241_732_096,
             ('mistral', 'mixtral_8x7b'): 46_702_792_704,
             ('qwen', 'qwen3_30b_a3b'): 30_532_122_624,
             ('gemma', 'gemma3_1b'): 999_885_952, ('gemma', 'gemma2_2b'): 2_614_341_888}


@pytest.mark.parametrize('config_file,size', list(PUBLISHED))
def test_named_sizes_have_the_published_parameter_count(config_file, size):
  """launch/configs/{llama,qwen,mistral}.py's published shapes: our parameters (shapes only) number
  what transformers builds from the config.json we would export for them (on the meta device),
  and the count the model cards publish."""
  cfg = disttrain.from_config_dict(helpers.config_file_arg(ROOT / 'launch' / 'configs' /
                                                           f'{config_file}.py', size))
  model = models.build(cfg.model, 'float32', cfg.data.seq_len)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             {'tokens': jnp.zeros((1, 8), jnp.int32)}))
  ours = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes['params']))
  config = exported_config.for_export(model.family, cfg.model, model.cfg, 'float32', {})
  with torch.device('meta'):
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config))
  assert type(reference).__name__ == hf_config.FAMILIES[model.family]
  assert ours == sum(p.numel() for p in reference.parameters())
  assert ours == PUBLISHED[config_file, size]


# llama's round trip: test_exported_run_loads_in_transformers_with_equal_logits[llama] and
# test_hf_saves (qwen2 is its decoder with biases).
DENSE = {'qwen2': lambda tmp: _qwen(tmp, 'qwen2', False),
         'qwen3': lambda tmp: _qwen(tmp, 'qwen3', True), 'mistral': _mistral}


@pytest.mark.slow  # two transformers models, a compile each for forward and decoding
@pytest.mark.parametrize('family', list(DENSE))
def test_dense_family_round_trips_and_decodes_as_transformers(tmp_path, family):
  """From the directory alone (launch/configs/hf.py's from_directory, as `generate --hf_dir`
  loads it): exported again, transformers' logits equal ours to 1e-5 and a second import is
  bitwise the first; 16 greedy tokens from the KV cache equal transformers' `generate` from 2
  prompts of different lengths. (tests/test_moe_families.py and test_gemma.py: the others.)"""
  path = DENSE[family](tmp_path)
  assert hf_round_trip.from_directory(path, tmp_path) == family
  lm = hf_round_trip.load(path)
  ours = _our_logits(lm.model, lm.params, TOKENS)
  np.testing.assert_allclose(ours, _reference_logits(path, TOKENS), rtol=1e-4, atol=1e-4)
  hf_round_trip.assert_exports_reimports_and_decodes(
      lm, path, tmp_path, TOKENS, ours, [[5, 17, 3, 98, 42], [8, 1, 64, 23, 7, 90, 11, 2, 36]])

"""The mixture-of-experts families from Hugging Face (Mixtral, Qwen3-MoE) against `transformers`.

Random tiny models with 4 experts, 2 per token, built by transformers and saved with
save_pretrained here (Mixtral with a sliding window of 4 in 16-token rows; Qwen3-MoE with a head
size of 24 apart from the width and norm_topk_prob off, random norm scales). Loaded as
`disttrain generate --hf_dir` loads them (the fields from config.json: routed dropless), their
logits equal transformers' eager float32 forward to 1e-4; exported again, transformers' logits
equal ours to 1e-5 and a second import is bitwise the first; greedy decoding with the KV cache
gives transformers' greedy `generate` tokens for 16 new tokens from 2 prompts of different
lengths. On fsdp x expert x tensor (8 devices) one step of each equals 1 device.
"""

import dataclasses
import gc
import types

import numpy as np
import pytest
import torch
import transformers

import jax.numpy as jnp

from disttrain.config import ModelConfig, RopeScalingConfig
from disttrain.hf import compare
from disttrain.hf import config as hf_config
from tests import hf_round_trip, test_context, test_llama
from tests.helpers import assert_trees_close

VOCAB = 101


def _save(tmp_path, family: str) -> str:
  torch.manual_seed(7)
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                num_experts_per_tok=2, tie_word_embeddings=False, attn_implementation='eager')
  if family == 'mixtral':
    config = transformers.MixtralConfig(num_local_experts=4, sliding_window=4,
                                        rope_theta=10_000.0, **common)
  else:
    config = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=48, head_dim=24,
                                         norm_topk_prob=False, rope_theta=1_000_000.0, **common)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(torch.randn_like(p) * 0.5 + 1.0)
      if name.endswith('gate.weight'):  # routers decisive enough that float rounding keeps picks
        p.mul_(20.0)
  path = str(tmp_path / family)
  model.save_pretrained(path)
  return path


def _logits(lm, tokens) -> np.ndarray:
  out = lm.model.module.apply({'params': lm.params}, jnp.asarray(tokens), False)
  return np.asarray(out)[..., :VOCAB]


@pytest.mark.slow  # two transformers models, a compile each for forward and decoding
@pytest.mark.parametrize('family', ['mixtral', 'qwen3_moe'])
def test_moe_family_imports_exports_and_decodes_as_transformers(tmp_path, family):
  path = _save(tmp_path, family)
  lm = hf_round_trip.load(path)
  assert hf_round_trip.from_directory(path, tmp_path) == lm.cfg.model.name  # launch/configs/hf.py: no field
  assert lm.model.family == family and lm.cfg.model.expert_capacity == 0  # dropless
  assert lm.model.cfg.moe_norm_topk == (family == 'mixtral')
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
  reference = hf_round_trip.reference(path)
  with torch.no_grad():
    want = reference(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(_logits(lm, tokens), want, rtol=1e-4, atol=1e-4)
  # disttrain compare of a run trained with a capacity still runs the model as transformers does
  capped = lm.model.module.clone(cfg=dataclasses.replace(lm.model.cfg, expert_capacity=1.0))
  assert np.abs(_logits(types.SimpleNamespace(model=types.SimpleNamespace(module=capped),
                                              params=lm.params), tokens) - want).max() > 1e-2
  # The routers are decisive (x20), so the top-2 gates nearly sum to 1: renormalising them or
  # not must still show (qwen3_moe's norm_topk_prob=False, Mixtral's always True).
  other = lm.model.module.clone(cfg=dataclasses.replace(
      lm.model.cfg, moe_norm_topk=not lm.model.cfg.moe_norm_topk))
  assert np.abs(_logits(types.SimpleNamespace(model=types.SimpleNamespace(module=other),
                                              params=lm.params), tokens) - want).max() > 1e-3
  run = types.SimpleNamespace(model=types.SimpleNamespace(module=capped, cfg=lm.model.cfg),
                              params=lm.params)
  np.testing.assert_allclose(compare._ours(run, tokens[0].tolist())[:, :VOCAB], want[0],
                             rtol=1e-4, atol=1e-4)

  hf_round_trip.assert_exports_reimports_and_decodes(
      lm, path, tmp_path, tokens, _logits(lm, tokens), [[5, 17, 3, 99, 42], [8, 1, 64, 23, 7, 90, 11, 2, 36]])


@pytest.mark.slow
@pytest.mark.parametrize('family', ['qwen3_moe', 'mixtral'])
def test_moe_family_on_fsdp_expert_tensor_equals_one_device(family):
  fields = {'model.name': family, 'model.num_experts': 4, 'model.experts_per_token': 2,
            'model.expert_capacity': 0.0}
  fields.update({'model.head_dim': 24, 'model.moe_norm_topk': False} if family == 'qwen3_moe'
                else {'model.sliding_window': 8})
  # Packed rows with padding at their ends, which routes nowhere (moe.py), on both sides.
  rows = test_context._packed(64, 32, 256)
  ref_loss, ref_grads = test_llama._one_step(test_llama._config(**test_llama.ONE, **fields), 1,
                                             train_data=rows)
  layout = {'mesh.data': 1, 'mesh.fsdp': 2, 'mesh.expert': 2, 'mesh.tensor': 2}
  loss, grads = test_llama._one_step(test_llama._config(**layout, **fields), 8, train_data=rows)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(grads, ref_grads, 1e-5, 1e-6, f'{family} gradient and update')


def test_a_split_import_reads_each_tensor_once_into_each_devices_share(tmp_path, monkeypatch):
  """Mixtral's weights onto experts over 4 devices and the last axis of every leaf over 2 (as
  fsdp splits a training run's): the parameters are 1 device's bit for bit, each tensor is read
  and converted once, and no device ever holds more than its final share. Each tensor was placed
  whole on every device and then stacked (8 experts of Qwen3-30B on every GPU at once), and
  converted again for every device block it touched."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from disttrain.hf import tensorfiles, weights  # pylint: disable=g-import-not-at-top
  path = _save(tmp_path, 'mixtral')
  one = hf_round_trip.load(path)
  mesh = jax.make_mesh((4, 2), ('expert', 'fsdp'), devices=jax.devices())
  def spec(key, leaf):
    axes = [None] * leaf.ndim
    if 'moe' in jax.tree_util.keystr(key) and leaf.ndim == 4:
      axes[1] = 'expert'
    if leaf.shape[-1] % 2 == 0:
      axes[-1] = 'fsdp'
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, P(*axes)))
  abstract = jax.tree_util.tree_map_with_path(spec, one.params)
  first = jax.devices()[0]  # what arrays on this mesh hold on it (other tests' are on others)
  on_first = lambda arrays: sum(s.data.nbytes for a in arrays
                                if getattr(a.sharding, 'mesh', None) == mesh
                                for s in a.addressable_shards if s.device == first)
  # No gc.collect() per read: on the suite's heap it made this test 96 s instead of 20.
  live = lambda: on_first(jax.live_arrays())
  gc.collect()
  held, names, read, before = [], [], tensorfiles.Reader.read, live()
  monkeypatch.setattr(tensorfiles.Reader, 'read', lambda self, name: (
      held.append(live()), names.append(name), read(self, name))[2])
  split = weights.load_params(path, 'mixtral', one.model.cfg, abstract)
  assert split['blocks']['moe']['gate'].sharding.spec == P(None, 'expert', None, 'fsdp')
  assert_trees_close(split, one.params, 0, 0, 'mixtral on expert x fsdp')
  assert 0 < max(held) - before <= on_first(jax.tree.leaves(split)), (held, before)
  assert len(names) == len(set(names)), names


def test_qwen3_moe_with_dense_layers_among_the_experts_is_refused_naming_the_field(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  from disttrain.errors import CheckpointError  # pylint: disable=g-import-not-at-top
  path = _save(tmp_path, 'qwen3_moe')
  config = json.loads((tmp_path / 'qwen3_moe' / 'config.json').read_text())
  (tmp_path / 'qwen3_moe' / 'config.json').write_text(json.dumps({**config,
                                                                  'mlp_only_layers': [1]}))
  with pytest.raises(CheckpointError, match=r"config.json mlp_only_layers=\[1\]; the qwen3_moe "
                                            r"family has mlp_only_layers=\[\]"):
    hf_round_trip.load(path)
  # null is transformers' [] (it loads such a config); the family checks pass
  null = {**config, 'mlp_only_layers': None}
  fields = hf_config.model_fields(null, 'qwen3_moe')
  cfg = ModelConfig(**{**fields, 'rope_scaling': RopeScalingConfig(**fields['rope_scaling'])})
  hf_config._check_rotary(path, 'qwen3_moe', null, cfg)  # pylint: disable=protected-access
  # transformers 5's own layout, all experts fused in one tensor: named, with how to save it
  (tmp_path / 'qwen3_moe' / 'config.json').write_text(json.dumps(config))
  fused = str(tmp_path / 'fused')
  transformers.AutoModelForCausalLM.from_pretrained(path).save_pretrained(
      fused, save_original_format=False)
  with pytest.raises(CheckpointError, match=r"fused expert tensors \(model.layers.0.mlp.experts."
                                            r'gate_up_proj\), .*save_original_format=True'):
    hf_round_trip.load(fused)


def test_the_balancing_loss_is_imported_where_transformers_adds_it(tmp_path):
  """transformers adds router_aux_loss_coef x its balancing loss only with output_router_logits
  (off in Mixtral's and Qwen3-MoE's configs): an import trained with it on anyway (0.02 here).
  A run's own weight or capacity is a training choice, not a contradiction of config.json,
  whatever its value; an export says
  output_router_logits where it has a weight, so its import has it again."""
  import json  # pylint: disable=g-import-not-at-top
  import disttrain  # pylint: disable=g-import-not-at-top
  from disttrain import models  # pylint: disable=g-import-not-at-top
  from disttrain.hf import config as hf_config, exported_config  # pylint: disable=g-import-not-at-top
  from tests import helpers  # pylint: disable=g-import-not-at-top
  from tests.conftest import ROOT  # pylint: disable=g-import-not-at-top
  config = transformers.MixtralConfig(num_local_experts=4, router_aux_loss_coef=0.02).to_dict()
  assert hf_config.model_fields(config, 'mixtral')['router_aux_weight'] == 0.0
  on = {**config, 'output_router_logits': True}
  assert hf_config.model_fields(on, 'mixtral')['router_aux_weight'] == 0.02
  (tmp_path / 'config.json').write_text(json.dumps({**config,
                                                    'architectures': ['MixtralForCausalLM']}))
  # Set to ModelConfig's defaults (0.01, 1.25) they are the run's too, not read as unset.
  for run_weight, want, capacity in ((None, 0.0, 0.0), (0.05, 0.05, 0.0), (0.01, 0.01, 1.25)):
    cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'hf.py')
    overrides = {'restore_from': str(tmp_path), 'data.name': 'text'}
    if run_weight is not None:
      overrides['model.router_aux_weight'] = run_weight
    if capacity:
      overrides['model.expert_capacity'] = capacity
    cfg = hf_config.from_directory(disttrain.from_config_dict(helpers.override(cd, overrides)))
    assert cfg.model.router_aux_weight == want and cfg.model.router_z_weight == 0.0
    assert cfg.model.expert_capacity == capacity
    decoder = models.build(cfg.model).cfg
    exported = exported_config.for_export('mixtral', cfg.model, decoder, 'float32', {})
    assert hf_config.model_fields(exported, 'mixtral')['router_aux_weight'] == want


@pytest.mark.slow  # two transformers models and two imports
def test_the_balancing_loss_of_an_import_is_transformers_aux_loss(tmp_path):
  """model.router_balance='transformers' (an import's): the model loss equals transformers'
  router_aux_loss_coef x aux_loss (load_balancing_loss_func: pooled over 3 layers, every choice
  counted) to float32 rounding, Mixtral and Qwen3-MoE, also with padding left out."""
  for family in ('mixtral', 'qwen3_moe'):
    torch.manual_seed(7)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.02)
    config = (transformers.MixtralConfig(num_local_experts=4, **common) if family == 'mixtral'
              else transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=48, **common))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / family)
    lm = hf_round_trip.load(str(tmp_path / family))
    assert (lm.cfg.model.router_balance, lm.cfg.model.router_aux_weight) == ('transformers', 0.02)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
    with torch.no_grad():
      aux = model(torch.tensor(tokens), output_router_logits=True).aux_loss.item()
    _, _, ours = lm.model.apply({'params': lm.params}, {'tokens': jnp.asarray(tokens)},
                                train=False, rng=None)
    np.testing.assert_allclose(float(ours), 0.02 * aux, rtol=1e-5)
    # Right padding: transformers leaves attention_mask's zeros out of the loss; packed rows'
    # padding (segment id 0) is left out here.
    mask = (np.arange(16) < np.array([[11], [7]])).astype(np.int64)
    with torch.no_grad():
      aux = model(torch.tensor(tokens), attention_mask=torch.tensor(mask),
                  output_router_logits=True).aux_loss.item()
    _, _, ours = lm.model.apply({'params': lm.params}, {
        'tokens': jnp.asarray(tokens), 'segment_ids': jnp.asarray(mask, jnp.int32),
        'positions': jnp.asarray(np.arange(16)[None] * mask, jnp.int32)}, train=False, rng=None)
    np.testing.assert_allclose(float(ours), 0.02 * aux, rtol=1e-5)

"""LoRA (disttrain/models/lora.py, disttrain/hf/adapters.py): adapters on a frozen base.

Data x fsdp x tensor (8 devices) equals 1 device to float reassociation (losses rtol 1e-4 over
4 Adam steps, adapters atol 1e-5: Adam's normalised steps of 1e-2 carry the gradients' 1e-6
differences); a resume is bitwise; the optimizer state is the adapters' alone and the frozen base
is never changed or saved. From a Hugging Face base: the merged export is W + (alpha / r) A B
(checked against the product written here), `transformers` gives our logits from it and `peft`
gives them from the adapter directory on the base, to 1e-5; the run's own Hugging Face save
(hf_save_every_steps) is the merged export.
"""

import json

import jax
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers

import disttrain
from disttrain.hf import export, trained
from tests import helpers
from tests.helpers import devices, to_numpy
from tests.test_llama import CUBE, ONE, _config

LORA = {'lora.rank': 4, 'lora.alpha': 8.0, 'num_train_steps': 4, 'log_every_steps': 1,
        'learning_rate': 1e-2, 'warmup_steps': 0, 'lr_schedule': 'constant',
        'checkpoint_every_steps': 2, 'data.eval_examples': 16, 'eval_batch_size': 16}


def _train(workdir, n: int, mesh: dict, steps: int = 4):
  cfg = _config(**{**LORA, **mesh, 'num_train_steps': steps})
  result = disttrain.train(cfg, str(workdir), devices=devices(n))
  losses = [r['loss'] for r in helpers.metrics_records(workdir)]
  return cfg, result, losses


@pytest.mark.slow
def test_lora_on_data_fsdp_tensor_equals_one_device_resumes_bitwise_and_keeps_adapter_state(
    tmp_path):
  cfg, one, losses = _train(tmp_path / 'one', 1, ONE)
  _, cube, cube_losses = _train(tmp_path / 'cube', 8, CUBE)
  np.testing.assert_allclose(cube_losses, losses, rtol=1e-4)
  assert losses[-1] < losses[0]
  helpers.assert_trees_close(to_numpy(cube.state.params), to_numpy(one.state.params), 1e-4, 1e-5,
                             'adapters after 4 steps')
  # Resumed at step 2 (the base re-made from the seed: checkpoints hold none): bitwise.
  _train(tmp_path / 'resumed', 1, ONE, steps=2)
  _, resumed, resumed_losses = _train(tmp_path / 'resumed', 1, ONE)
  assert resumed_losses == losses
  for a, b in zip(jax.tree.leaves(to_numpy(resumed.state.params)),
                  jax.tree.leaves(to_numpy(one.state.params)), strict=True):
    np.testing.assert_array_equal(a, b)
  # The base is the fresh one, untouched by training; the checkpoint has the adapters alone.
  fresh = disttrain.setup(cfg, devices=devices(1)).state.mutable['frozen']
  for a, b in zip(jax.tree.leaves(to_numpy(one.state.mutable['frozen'])),
                  jax.tree.leaves(to_numpy(fresh)), strict=True):
    np.testing.assert_array_equal(a, b)
  saved = helpers.saved_params(tmp_path / 'one', 4)
  adapters = jax.tree.leaves(to_numpy(one.state.params))
  assert sum(x.size for x in saved) == sum(x.size for x in adapters)
  parts = {name: json.loads((tmp_path / name / 'run.json').read_text())[
      'state_bytes_per_device_by_part'] for name in ('one', 'cube')}
  for part in parts.values():
    # Adam's two moments of the adapters (and its step count); nothing for the frozen base.
    assert part['params'] * 2 <= part['opt_state'] <= part['params'] * 2 + 64, part
  base_bytes = sum(x.nbytes for x in jax.tree.leaves(to_numpy(fresh)))
  assert parts['one']['frozen'] == base_bytes  # float32, stored once
  assert parts['cube']['frozen'] <= base_bytes / 3, parts  # split over fsdp and tensor


def test_the_frozen_base_takes_the_param_rules_of_the_weights_it_holds():
  """A param_rules regex anchored at a weight's path ('^blocks/...') was matched against
  'frozen/blocks/...' under LoRA: the same weight fell back to the logical rules' layout."""
  rule = {'param_rules': (('^blocks/mlp/down/kernel$', (None, None, 'tensor')),),
          'mesh.data': 4, 'mesh.tensor': 2}
  specs = {}
  for rank in (0, 4):
    layout = disttrain.setup(_config(**{**rule, 'lora.rank': rank}), devices=devices(8)).layout
    tree = layout.param_specs if not rank else jax.tree.map(
        lambda s: s.spec, layout.shardings.mutable['frozen'])
    specs[rank] = tree['blocks']['mlp']['down']['kernel']
  assert specs[4] == specs[0] == jax.sharding.PartitionSpec(None, None, 'tensor'), specs


def hf_llama(tmp_path, vocab: int = 256) -> str:
  """A tiny untied Llama saved by transformers (the LoRA and DPO tests' base)."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
  path = str(tmp_path / 'base')
  transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
  return path


def _logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.slow
def test_lora_on_a_hugging_face_base_exports_merged_and_as_peft_with_equal_logits(tmp_path):
  base = hf_llama(tmp_path)
  cfg = _config(**{**LORA, **ONE, 'restore_from': base, 'model.mlp_dim': 128,
                   'model.tied_embeddings': False, 'lora.dropout': 0.1, 'learning_rate': 5e-2,
                   'hf_save_every_steps': 4})
  workdir = str(tmp_path / 'run')
  result = disttrain.train(cfg, workdir, devices=devices(1))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)
  model = disttrain.setup(cfg, devices=devices(1)).model  # the run's LoRA model
  state = result.state
  ours = np.asarray(model.apply({'params': state.params, **state.mutable},
                                {'tokens': tokens}, train=False, rng=None)[0])[..., :256]

  merged_dir, adapter_dir = str(tmp_path / 'merged'), str(tmp_path / 'adapter')
  export.export(workdir, merged_dir)
  export.export(workdir, adapter_dir, adapter=True)
  half = str(tmp_path / 'adapter_bf16')  # --dtype was ignored: float32 tensors
  export.export(workdir, half, adapter=True, dtype='bfloat16')
  with open(f'{half}/adapter_model.safetensors', 'rb') as f:  # the header: 8-byte length, JSON
    header = json.loads(f.read(int.from_bytes(f.read(8), 'little')))
  assert {v['dtype'] for k, v in header.items() if k != '__metadata__'} == {'BF16'}
  # The merged query of layer 1 is W + (alpha / r) A B, in torch's [out, in].
  lm = trained.load(workdir=workdir, devices=devices(1), mesh={'data': 1})
  a = np.asarray(lm.adapters['blocks']['attention']['query_lora']['a'])[1]  # [D, r]
  b = np.asarray(lm.adapters['blocks']['attention']['query_lora']['b'])[1]  # [r, N, K]
  assert np.abs(b).max() > 1e-3  # trained away from B = 0
  name = 'model.layers.1.self_attn.q_proj.weight'
  w = safetensors.numpy.load_file(f'{base}/model.safetensors')[name]
  want = w + (8.0 / 4) * (a @ b.reshape(4, -1)).T
  got = safetensors.numpy.load_file(f'{merged_dir}/model.safetensors')
  np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6)
  during = safetensors.numpy.load_file(f'{workdir}/hf/4/model.safetensors')  # the run's own save
  assert during.keys() == got.keys()
  for key, value in got.items():
    np.testing.assert_array_equal(during[key], value)

  load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation='eager').eval()
  np.testing.assert_allclose(_logits(load(merged_dir), tokens), ours, rtol=1e-5, atol=1e-5)
  with_adapters = peft.PeftModel.from_pretrained(load(base), adapter_dir).eval()
  np.testing.assert_allclose(_logits(with_adapters, tokens), ours, rtol=1e-5, atol=1e-5)
  assert np.abs(_logits(load(base), tokens) - ours).max() > 1e-3  # the adapters matter


def test_a_bfloat16_adapter_is_peft_s_product_bit_for_bit():
  """In bfloat16, B(A x) scaled by alpha / r = 16 / 3 as PEFT's bf16 tensor * float: the scale
  unrounded, the product rounded once (a bfloat16 scale, 5.34375, changed a third of the
  values by an ulp)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from disttrain.models import lora  # pylint: disable=g-import-not-at-top
  spec = lora.LoraSpec(rank=3, alpha=16.0)
  adapter = lora.Adapter(spec, (40,), ('embed',), ('mlp',), 'up/kernel', jnp.bfloat16)
  rng = np.random.default_rng(0)
  x, a, b = (rng.normal(size=s).astype(np.float32) for s in ((64, 32), (32, 3), (3, 40)))
  ours = adapter.apply({'params': {'a': a, 'b': b}}, jnp.asarray(x))
  bf16 = lambda v: torch.tensor(v).bfloat16()
  reference = (bf16(x) @ bf16(a)) @ bf16(b) * spec.scale
  np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)),
                                reference.float().numpy())


def test_model_flops_count_a_frozen_base_and_a_sliding_window():
  """Model FLOPs of a LoRA run: every weight runs forward and passes gradients back (4 per token
  and weight), only the adapters also get weight gradients (2 more). They counted the adapters
  alone (0.14 of the full model's figure here; negative with a large untied vocabulary). A
  sliding window of 8 attends to at most 8 positions per query (every layer counted all t)."""
  from disttrain.training import setup as setup_lib  # pylint: disable=g-import-not-at-top
  full = disttrain.setup(_config(**ONE), devices=devices(1))
  adapted = disttrain.setup(_config(**{**LORA, **ONE}), devices=devices(1))
  count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  n, adapters = count(full.state.params), count(adapted.state.params)
  cfg = full.model.cfg
  t = int(full.step_spec['tokens'].shape[1]) if full.step_spec else cfg.max_seq_len
  lookups = 0 if cfg.tied_embeddings else cfg.padded_vocab * cfg.width  # a table read, no matmul
  attention = 12 * cfg.num_layers * t * t * cfg.num_heads * cfg.head_dim
  want = 4 * t * (n - lookups) + 6 * t * adapters + attention
  assert setup_lib.throughput(adapted).flops_per_example == pytest.approx(want, rel=1e-12)
  assert setup_lib.throughput(full).flops_per_example == pytest.approx(
      6 * t * (n - lookups) + attention, rel=1e-12)
  windowed = disttrain.setup(_config(**ONE, **{'model.sliding_window': 8}), devices=devices(1))
  assert t > 8 and setup_lib.throughput(windowed).flops_per_example == pytest.approx(
      6 * t * (n - lookups) + attention * 8 / t, rel=1e-12)


def test_lora_on_a_mixture_of_experts_model_says_its_experts_stay_frozen(capsys):
  """The default targets name MLP projections a MoE layer has none of: one line says so."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from disttrain import models  # pylint: disable=g-import-not-at-top
  from disttrain.config import LoraConfig, ModelConfig  # pylint: disable=g-import-not-at-top
  from disttrain.models import lora  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(name='mixtral', hidden=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    mlp_dim=48, vocab_size=64, num_experts=4, experts_per_token=2)
  model = lora.adapt(models.build(cfg, 'float32', 8), LoraConfig(rank=2))
  assert 'the 4 experts and the router of each mixture-of-experts layer take no adapters' in (
      capsys.readouterr().err)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             {'tokens': jnp.zeros((1, 8), jnp.int32)}))
  assert {p.split('/')[1] for p in lora.pairs(shapes['params'])} == {'attention'}

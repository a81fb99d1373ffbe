"""Sampling: KV-cache decoding equals the full forward pass, compiles once, and the commands.

The model is a tiny Llama trained 20 steps on byte text on 8 devices with its parameters split
over fsdp, loaded back onto that mesh by disttrain.hf.trained (the run's layout).
"""

import dataclasses
import json
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import disttrain
from disttrain.errors import ConfigError
from disttrain.models import decoding
from disttrain.models.decoder import Decoder
from disttrain.hf import trained
from tests import helpers
from tests.conftest import ROOT, subprocess_env
from tests.helpers import devices

pytestmark = pytest.mark.slow  # each test needs the module's 20-step run on 8 devices

PROMPTS = ['def ', 'import os\nimport sys\n', 'class Foo(object):\n    """A']


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  helpers.override(cd, {'model.num_layers': 2, 'model.hidden': 64, 'model.num_heads': 4,
                        'model.num_kv_heads': 2, 'model.mlp_dim': 128, 'data.seq_len': 64,
                        'global_batch_size': 16, 'data.text.bytes': 200_000,
                        'data.eval_examples': 16, 'eval_batch_size': 16, 'num_train_steps': 20,
                        'mesh.data': 1, 'mesh.fsdp': 8, 'sharding': 'fsdp', 'fsdp_min_size': 256,
                        'eval_every_steps': 0, 'model.vocab_size': 260})
  workdir = tmp_path_factory.mktemp('gen_run')
  disttrain.train(disttrain.from_config_dict(cd), str(workdir), devices=devices(8))
  return workdir


def test_greedy_decoding_with_the_cache_equals_the_full_forward_argmax(run_dir):
  """3 prompts of different lengths, 32 new tokens each, parameters split over fsdp=8: every
  generated token is the argmax of the full forward pass over prompt + tokens so far; also with
  the same weights under a sliding window of 8 positions (Mistral's attention), which the cached
  keys of the left-padded prompts must respect."""
  lm = trained.load(workdir=str(run_dir), devices=devices(8))
  assert dict(lm.mesh.shape)['fsdp'] == 8
  assert 'fsdp' in str(lm.params['blocks']['mlp']['up']['kernel'].sharding.spec)
  prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
  assert len({len(p) for p in prompts}) == 3
  windowed = dataclasses.replace(lm.model, module=Decoder(
      dataclasses.replace(lm.model.cfg, sliding_window=8)))
  params = jax.device_get(lm.params)
  for model in (lm.model, windowed):
    before = decoding.TRACES[0]  # pylint: disable=protected-access
    out = disttrain.generate(model, lm.params, prompts, max_new_tokens=32, mesh=lm.mesh,
                             context=lm.context)
    assert decoding.TRACES[0] == before + 1  # pylint: disable=protected-access
    for prompt, new, logprobs in zip(prompts, out.tokens, out.logprobs):
      assert len(new) == 32  # the byte tokenizer's EOS (256) is never likely here
      sequence = jnp.asarray([prompt + new])
      logits = np.asarray(model.module.apply({'params': params}, sequence, False))[0]
      np.testing.assert_array_equal(logits[len(prompt) - 1:-1].argmax(-1), new)
      # The cached pass's own scores equal the full pass's at every position (positions, cache
      # slots and masks all right, not only the argmax).
      full = jax.nn.log_softmax(logits[len(prompt) - 1:-1], axis=-1)[np.arange(32), new]
      np.testing.assert_allclose(logprobs, full, rtol=1e-4, atol=1e-4)
  again = disttrain.generate(lm.model, lm.params, [p[::-1] for p in prompts], max_new_tokens=32,
                             mesh=lm.mesh, context=lm.context)
  assert again.traces == out.traces  # same shapes: the compiled loop is reused, not re-traced


def test_sampling_settings(run_dir):
  # --mesh=data=-1 (the docs' advice for other devices) kept the run's fsdp=8: refused on 2.
  assert dict(trained.load(workdir=str(run_dir), devices=devices(2), mesh='data=-1').mesh.shape)[
      'data'] == 2
  lm = trained.load(workdir=str(run_dir), devices=devices(1), mesh={'fsdp': 1})
  prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
  run = lambda **kw: disttrain.generate(lm.model, lm.params, prompts, max_new_tokens=16,
                                        **kw).tokens
  greedy = run()
  assert run(temperature=1.0, top_k=1) == greedy  # one candidate: the argmax
  assert run(temperature=1.0, top_p=1e-6) == greedy  # the smallest nucleus: the argmax
  assert run(temperature=1.0, seed=3) == run(temperature=1.0, seed=3)
  assert run(temperature=1.0, seed=3) != run(temperature=1.0, seed=4)
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  draws = [int(decoding.sample(logits, jax.random.key(i), 1.0, 0, 0.7)[0])
           for i in range(300)]
  assert set(draws) == {0, 1}  # top_p 0.7: 0.5 + 0.3 reach it, 0.15 and 0.05 are cut
  draws = [int(decoding.sample(logits, jax.random.key(i), 1.0, 3, 1.0)[0])
           for i in range(300)]
  assert set(draws) == {0, 1, 2}
  assert int(decoding.sample(logits, jax.random.key(0), 1.0, 10**6, 1.0)[0]) in range(4)  # all
  # transformers' limits, one line each (a traceback, token 0 forever, or a silent 1).
  for setting, message in [({'temperature': -1.0}, 'temperature=-1.0 is out of range'),
                           ({'top_p': 0.0}, 'top_p=0.0 is out of range'),
                           ({'top_p': 2.0}, 'top_p=2.0 is out of range'),
                           ({'top_k': -1}, 'top_k=-1 is out of range'),
                           ({'max_new_tokens': 0}, 'max_new_tokens=0 is out of range')]:
    with pytest.raises(ConfigError, match=message):
      disttrain.generate(lm.model, lm.params, prompts, **{'max_new_tokens': 4, **setting})
  with pytest.raises(ConfigError, match=r"prompt token id 300 is outside the model's 260 ids"):
    disttrain.generate(lm.model, lm.params, [[1, 300]], max_new_tokens=4)
  with pytest.raises(ConfigError, match=r'--step picks among a run\'s checkpoints; --hf_dir'):
    trained.load(hf_dir=str(run_dir), step=3)


def _env() -> dict:
  return subprocess_env()


def _cli(*args: str):
  return subprocess.run([sys.executable, '-m', *args], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=180, check=False)


def test_generate_command_from_the_run_and_from_its_hugging_face_export(run_dir, tmp_path):
  args = ['--prompt=def ', '--prompt=import ', '--max_new_tokens=12', '--fake_devices=8']
  proc = _cli('disttrain', 'generate', f'--workdir={run_dir}', *args)
  assert proc.returncode == 0, proc.stderr[-2000:]
  last = proc.stdout.splitlines()[-1]
  mesh = "{'data': 1, 'stage': 1, 'fsdp': 8, 'expert': 1, 'context': 1, 'tensor': 1}"
  assert 'tokens/s' in last and mesh in last
  export = _cli('disttrain', 'export', f'--workdir={run_dir}', f'--out={tmp_path / "hf"}')
  assert export.returncode == 0, export.stderr[-2000:]
  from_hf = _cli('disttrain', 'generate', f'--hf_dir={tmp_path / "hf"}', *args, '--json=-')
  assert from_hf.returncode == 0, from_hf.stderr[-2000:]
  out = json.loads(from_hf.stdout)  # --json=-: the JSON alone
  # The same greedy continuations: the run's printed texts are the export's tokens decoded.
  assert [f'{s["prompt"]}{s["text"]}\n' for s in out['samples']] == [
      t.lstrip('\n') for t in proc.stdout.split('---')[:2]]
  for sample in out['samples']:
    assert len(sample['logprobs']) == len(sample['tokens']) and sample['stop'] in ('eos', 'length')
    assert all(-30 < lp <= 0 for lp in sample['logprobs'])
    assert (sample['stop'] == 'length') == (len(sample['tokens']) == 12)
  assert out['settings']['temperature'] == 0 and np.prod(list(out['mesh'].values())) == 8


def test_a_run_saved_with_fields_it_did_not_use_still_loads():
  """Fields a run ignored are refused since 2026-11-29; a run saved before (lora.alpha without a
  rank, a harness limit without tasks) must still load for generate, export and lm-eval."""
  from disttrain.hf import trained  # pylint: disable=g-import-not-at-top
  cfg = trained._config({'lora': {'alpha': 32.0}, 'dpo': {'beta': 0.5},  # pylint: disable=protected-access
                         'data': {'eval_harness_limit': 5, 'mixture_exhausted': 'stop'}}, None)
  assert (cfg.lora.alpha, cfg.dpo.beta, cfg.data.eval_harness_limit) == (16.0, 0.1, 0)
  # Built otherwise, refused since: gpt's rotary fields, Gemma's norm, a name's rules after the
  # first (the last held). Each must build the model the run trained.
  cfg = trained._config({'model': {'name': 'gpt', 'rope_theta': 5e5, 'head_dim': 8,  # pylint: disable=protected-access
                                   'rope_scaling': {'kind': 'linear', 'factor': 2.0}},
                         'logical_rules': [['mlp', 'tensor'], ['mlp', None]]}, None)
  disttrain.models.build(cfg.model)
  assert (cfg.model.rope_theta, cfg.model.rope_scaling.kind) == (1e4, '')
  assert cfg.logical_rules == (('mlp', None),)
  gemma = trained._config({'model': {'name': 'gemma2', 'norm': 'layernorm'}}, None)  # pylint: disable=protected-access
  disttrain.models.build(gemma.model)


@pytest.mark.parametrize('command,args,message', [
    ('generate', ['--prompt=' + 'x' * 80, '--max_new_tokens=8'],
     'a prompt of 80 tokens + max_new_tokens=8 is longer than the model context of 64 tokens'),
    ('generate', ['--prompt=a', '--workdir={empty}'], 'has no checkpoints directory'),
    ('generate', ['--prompt=a', '--chat'], "the tokenizer '(bytes)' has no chat template"),
    ('generate', ['--prompt=a', '--json=/nonexistent/x.json'], '/nonexistent is not a directory'),
    ('generate', ['--prompt=a', '--top_p=0.9'],  # greedy: it was ignored without a word
     '--top_p chooses among the tokens to sample, but --temperature=0 is greedy'),
    ('generate', [], '--prompt is required (Prompt text); pass --prompt=<value>'),  # two lines
    ('export', ['--out={empty}/hf', '--workdir={empty}'], 'has no checkpoints directory'),
])
def test_bad_sampling_and_export_inputs_are_one_line_and_exit_2(run_dir, tmp_path, command, args,
                                                                message):
  args = [a.replace('{empty}', str(tmp_path)) for a in args]
  if not any(a.startswith('--workdir') for a in args):
    args.append(f'--workdir={run_dir}')
  proc = _cli('disttrain', command, *args, *(['--fake_devices=8'] if command == 'generate' else []))
  errors = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
  assert errors[0].startswith('error: ') and message in errors[0], errors[0]


def test_the_sample_at_the_end_of_a_run_fits_its_prompt_into_the_context(run_dir, capsys):
  """An example config's SampleAtEnd (launch/configs/llama_docs.py) on a run of 64-token rows:
  a prompt of 60 bytes gets the 4 greedy tokens that fit (48 asked; a finished run failed with
  a CallbackError at its end), one that fills the context gets none, said."""
  from disttrain.hf.generate import SampleAtEnd  # pylint: disable=g-import-not-at-top
  lm = trained.load(workdir=str(run_dir), devices=devices(8))
  result = types.SimpleNamespace(state=types.SimpleNamespace(params=lm.params, mutable={}))
  prompt = 'import os\n' * 6
  SampleAtEnd(lm.cfg, [prompt]).on_end(result)
  ids = lm.tokenizer.encode(prompt)
  want = disttrain.generate(lm.model, lm.params, [ids], max_new_tokens=4, mesh=lm.mesh,
                            context=64).tokens[0]
  assert len(ids) == 60 and len(want) == 4
  assert capsys.readouterr().out == \
      f'sample: {prompt + lm.tokenizer.continuation(ids, want)!r}\n'
  SampleAtEnd(lm.cfg, ['x' * 64]).on_end(result)
  assert capsys.readouterr().out == \
      "sample: none, a prompt of 64 tokens fills the model's context of 64\n"

"""Hugging Face saves during a run (hf_save_every_steps) and the logit checker (disttrain compare).

A 4-step Llama run on data x fsdp x tensor writes DIR/hf/2 and DIR/hf/4; `transformers` loads
them; `disttrain compare` of the run's step-4 checkpoint against DIR/hf/4 passes (float32 on
both sides: KL ~1e-13, logits within 1e-4) and fails, exit 1, once one tensor of the save is
perturbed. The bucket path of the same writer is tested in tests/test_buckets.py.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import disttrain
from tests import helpers
from tests.conftest import ROOT, subprocess_env
from tests.helpers import devices


def _compare(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
  env = subprocess_env()
  out = args[-1].split('=', 1)[1]
  proc = subprocess.run([sys.executable, '-m', 'disttrain', 'compare', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  with open(out, encoding='utf-8') as f:
    return proc, json.load(f)


def _compare_here(capsys, *args: str) -> tuple[int, str, dict]:
  """`disttrain compare` run by its CLI in this process, imports and transformers already loaded
  (a second subprocess cost ~10 s: test 61 s -> 51 s, 2026-11-27): exit status, stdout, the JSON.
  The flags other disttrain tools defined when this process imported them (hf/export.py's
  --workdir, --step and its required --out) are set aside meanwhile; they and sys.argv are
  restored."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from disttrain import cli  # pylint: disable=g-import-not-at-top
  kept = {flag.name: (module, flag) for module, module_flags
          in flags.FLAGS.flags_by_module_dict().items() if module.startswith('disttrain')
          for flag in module_flags}
  for name in kept:
    delattr(flags.FLAGS, name)
  defined, parsed, argv = set(flags.FLAGS), flags.FLAGS.is_parsed(), sys.argv
  capsys.readouterr()
  try:
    with pytest.raises(SystemExit) as exit_:
      cli.main(['disttrain', 'compare', *args])
  finally:
    sys.argv = argv
    for name in set(flags.FLAGS) - defined:
      delattr(flags.FLAGS, name)
    for name, (module, flag) in kept.items():
      flags.FLAGS[name] = flag
      flags.FLAGS.register_flag_by_module(module, flag)
    if not parsed:
      flags.FLAGS.unparse_flags()
  with open(args[-1].split('=', 1)[1], encoding='utf-8') as f:
    return exit_.value.code, capsys.readouterr().out, json.load(f)


@pytest.mark.slow  # an 8-device run and two compares that load transformers
def test_saves_during_a_run_load_in_transformers_and_compare_catches_a_perturbed_tensor(
    tmp_path, capsys):
  import transformers  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'llama.py')
  helpers.override(cd, {'model.num_layers': 2, 'model.hidden': 64, 'model.num_heads': 4,
                        'model.num_kv_heads': 2, 'model.mlp_dim': 128, 'data.seq_len': 32,
                        'global_batch_size': 16, 'data.text.bytes': 50_000,
                        'data.eval_examples': 16, 'eval_every_steps': 0, 'num_train_steps': 4,
                        'checkpoint_every_steps': 2, 'hf_save_every_steps': 2,
                        'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2})
  workdir = tmp_path / 'run'
  disttrain.train(disttrain.from_config_dict(cd), str(workdir), devices=devices(8))
  assert sorted(os.listdir(workdir / 'hf')) == ['2', '4']
  saved = {step: load_file(str(workdir / 'hf' / step / 'model.safetensors'))
           for step in ('2', '4')}
  assert any(not np.array_equal(saved['2'][k], saved['4'][k]) for k in saved['4'])  # trained on
  model = transformers.AutoModelForCausalLM.from_pretrained(workdir / 'hf' / '4')
  assert type(model).__name__ == 'LlamaForCausalLM'

  proc, out = _compare(f'--workdir={workdir}', '--step=4', f'--hf_dir={workdir / "hf" / "4"}',
                       f'--json={tmp_path / "ok.json"}')
  assert proc.returncode == 0 and proc.stdout.startswith('ok: '), proc.stdout + proc.stderr[-2000:]
  assert out['kl_max'] < 1e-9 and out['max_logit_diff'] < 1e-4, out

  perturbed = tmp_path / 'perturbed'
  shutil.copytree(workdir / 'hf' / '4', perturbed)
  tensors = load_file(str(perturbed / 'model.safetensors'))
  name = 'model.layers.1.mlp.down_proj.weight'
  tensors[name] = tensors[name] + np.random.default_rng(0).normal(
      0, 1.0, tensors[name].shape).astype(np.float32)
  save_file(tensors, str(perturbed / 'model.safetensors'), metadata={'format': 'pt'})
  # The failing compare in this process; the passing one above ran the installed command.
  status, stdout, out = _compare_here(capsys, f'--workdir={workdir}', '--step=4',
                                      f'--hf_dir={perturbed}', f'--json={tmp_path / "bad.json"}')
  assert status == 1 and stdout.startswith('FAIL: '), stdout
  assert out['kl_max'] > 0.015 and out['failed'], out


def test_saves_of_a_model_no_hugging_face_layout_holds_are_refused_before_training(tmp_path):
  from disttrain.errors import ConfigError  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match=r'hf_save_every_steps=2: the run: a Hugging Face '
                                        r'directory holds a language model'):
    disttrain.train(helpers.make_config(hf_save_every_steps=2, num_train_steps=2), str(tmp_path),
                    devices=devices(1))
  assert not (tmp_path / 'checkpoints').exists()


def test_a_diverged_run_writes_no_hugging_face_save(tmp_path):
  """hf_save_every_steps wrote DIR/hf/2 of NaN weights (no finite check, no flush of the
  records at that step) before the NonFiniteError said the state was not saved."""
  from disttrain.errors import NonFiniteError  # pylint: disable=g-import-not-at-top
  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'char_lm.py')
  cfg = disttrain.from_config_dict(helpers.override(cd, {
      'num_train_steps': 4, 'hf_save_every_steps': 2, 'log_every_steps': 4, 'optimizer': 'sgd',
      'learning_rate': 1e38, 'lr_schedule': 'constant', 'warmup_steps': 0,
      'eval_every_steps': 0, 'global_batch_size': 8, 'data.seq_len': 32,
      'model.num_layers': 1, 'model.hidden': 32}))
  with pytest.raises(NonFiniteError, match='that state was not saved'):
    disttrain.train(cfg, str(tmp_path), devices=devices(1))
  assert not (tmp_path / 'hf').exists() or not os.listdir(tmp_path / 'hf')


def test_a_run_a_callback_ends_exports_its_last_step(tmp_path):
  """A callback's stop ends the run normally, so its last step is exported as num_train_steps
  would be (it was not: DIR/hf held nothing when early stopping ended a run between saves); a
  relaunch stops there again (it trained on) and writes a save a kill cut short (it skipped it)."""

  class StopAt2(disttrain.Callback):  # the run stops at the next step, 3 (records lag one)
    def on_train_record(self, record):
      return disttrain.STOP if record['step'] == 2 else None

  cd = helpers.config_file(ROOT / 'launch' / 'configs' / 'char_lm.py')
  cfg = disttrain.from_config_dict(helpers.override(cd, {
      'num_train_steps': 8, 'hf_save_every_steps': 4, 'log_every_steps': 1,
      'eval_every_steps': 0, 'global_batch_size': 8, 'data.seq_len': 32,
      'model.num_layers': 1, 'model.hidden': 32}))
  disttrain.train(cfg, str(tmp_path), devices=devices(1), callbacks=[StopAt2()])
  assert sorted(os.listdir(tmp_path / 'hf')) == ['3']
  assert (tmp_path / 'hf' / '3' / 'config.json').exists()
  # Killed while writing it, after checkpoint 3 committed (config.json comes last): the relaunch
  # trains no step more (the callback stopped the run there) and writes the save whole.
  saved = (tmp_path / 'hf' / '3' / 'model.safetensors').read_bytes()
  (tmp_path / 'hf' / '3' / 'config.json').unlink()
  again = disttrain.train(cfg, str(tmp_path), devices=devices(1), callbacks=[StopAt2()])
  assert again.step == 3 and again.stopped_by == 'StopAt2' and not again.records
  assert (tmp_path / 'hf' / '3' / 'config.json').exists()
  assert (tmp_path / 'hf' / '3' / 'model.safetensors').read_bytes() == saved

"""A LoRA run's base weights and its adapters in Hugging Face form.

The frozen base (lora.FROZEN) is never checkpointed: `load_base` reads it from restore_from's
Hugging Face directory (or leaves the seed's fresh initialisation, which a resume recreates
exactly). `merged` gives the plain model's parameters, W + (alpha / r) A B, for export, HF saves
and sampling. `write_peft` writes the adapters as a PEFT directory (adapter_config.json +
adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the base model.
"""

import json
import re
from typing import Any

import jax
import numpy as np
import optax

from disttrain.config import Config
from disttrain.errors import ConfigError
from disttrain.hf import families, tensorfiles, weights as hf
from disttrain.models import lora, preference
from disttrain.parallel import state as state_lib
from disttrain.storage import checkpoint_reads, urls


def load_base(cfg: Config, model: lora.LoraModel, abstract_frozen) -> Any | None:
  """The base weights from restore_from (a Hugging Face directory) in lora.base_dtype, or None
  where the fresh initialisation is the base (no restore_from)."""
  if not cfg.restore_from:
    return None
  if not hf.is_hf_dir(cfg.restore_from):
    raise ConfigError(f'the frozen weights (LoRA\'s base, DPO\'s reference) come from a Hugging '
                      f'Face directory, but restore_from={cfg.restore_from!r} is not one; export '
                      'that run first (disttrain export --workdir=RUN --out=HF_DIR) and '
                      'restore_from=HF_DIR')
  params = hf.restore(cfg.restore_from, model, cfg.model, abstract_frozen)
  return jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract_frozen)


def merged(model: lora.LoraModel, params, frozen):
  """The plain model's parameters (float32), laid out as the base is."""
  shardings = jax.tree.map(lambda x: x.sharding, frozen)
  return jax.jit(lambda f, a: lora.merge(f, a, model.spec.scale),
                 out_shardings=shardings)(frozen, params)


def plain_params(model, state) -> Any:
  """state.params, merged with the frozen base for a LoRA model."""
  while isinstance(model, preference.WithReference):
    model = model.model
  if not isinstance(model, lora.LoraModel):
    return state.params
  return merged(model, state.params, state.mutable[state_lib.FROZEN])


def load_run(cfg: Config, model: lora.LoraModel, spec: dict, mesh, workdir: str, step: int):
  """A LoRA run's merged parameters: its base (load_base, else the seed's init) and the
  adapters of its checkpoint at `step`."""
  lay = state_lib.layout(model, optax.identity(), spec, cfg, mesh, check=False)
  shapes = jax.eval_shape(lambda: state_lib.init_variables(model, spec, cfg.seed))
  abstract = lambda tree, shardings: jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)
  frozen_sh = lay.shardings.mutable[state_lib.FROZEN]
  frozen = load_base(cfg, model, abstract(shapes[state_lib.FROZEN], frozen_sh))
  if frozen is None:
    frozen = jax.jit(lambda: state_lib.init_variables(model, spec, cfg.seed)[state_lib.FROZEN],
                     out_shardings=frozen_sh)()
  adapters = checkpoint_reads.restore_subtree(
      workdir, step, {'params': abstract(shapes['params'], lay.shardings.params)})['params']
  return merged(model, adapters, frozen), adapters


def _peft_entries(family: str, adapters) -> list[tuple[str, np.ndarray]]:
  """(PEFT tensor name, value) of every adapter matrix, one per layer."""
  table = {t.ours: t for t in hf.TABLES[family]}
  out = []
  for kernel_path, (a, b) in lora.pairs(adapters).items():
    entry = table[kernel_path]
    if '{j}' in entry.hf:
      raise ConfigError(f'{kernel_path}: adapters on experts have no PEFT layout here')
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    lead = 1 if '{i}' in entry.hf else 0
    module = 'base_model.model.' + entry.hf.removesuffix('.weight')
    for i in range(a.shape[0] if lead else 1):
      ai, bi = (a[i], b[i]) if lead else (a, b)
      name = module.format(i=i)
      out.append((f'{name}.lora_A.weight', ai.reshape(-1, ai.shape[-1]).T.copy()))
      out.append((f'{name}.lora_B.weight', bi.reshape(bi.shape[0], -1).T.copy()))
  return out


def write_peft(out: str, family: str, cfg: Config, adapters, base_name: str = '',
               dtype: str = 'float32') -> list[str]:
  """Writes adapter_config.json and adapter_model.safetensors (tensors in `dtype`: float32 or
  bfloat16) to `out`; the tensor names."""
  entries = _peft_entries(family, adapters)
  modules = sorted({re.escape(n.removeprefix('base_model.model.').rsplit('.lora_', 1)[0])
                    for n, _ in entries})
  pattern = '|'.join(sorted({re.sub(r'\\\.\d+\\\.', r'\\.\\d+\\.', m) for m in modules}))
  config = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': cfg.lora.rank,
            'lora_alpha': cfg.lora.alpha, 'lora_dropout': cfg.lora.dropout,
            'target_modules': f'({pattern})', 'bias': 'none', 'fan_in_fan_out': family == 'gpt',
            'use_rslora': False, 'use_dora': False, 'inference_mode': True,
            'init_lora_weights': True, 'modules_to_save': None,
            'base_model_name_or_path': base_name or cfg.restore_from or None,
            'auto_mapping': {'base_model_class': families.FAMILIES[family],
                             'parent_library': 'transformers.models'}}
  urls.path(out).mkdir(parents=True, exist_ok=True)
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  np_dtype = np.float32 if dtype == 'float32' else ml_dtypes.bfloat16
  tensors = [(name, value.shape, np_dtype, lambda v=value: v) for name, value in entries]
  tensorfiles.write(out, tensors, max_shard_bytes=2**62, metadata={'format': 'pt'},
                    file_name='adapter_model.safetensors')
  urls.write_text(urls.join(out, 'adapter_config.json'), json.dumps(config, indent=2))
  return [n for n, _ in entries]

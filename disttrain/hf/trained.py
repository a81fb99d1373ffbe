"""A trained language model, loaded for sampling or export: a run's checkpoint or a Hugging Face
directory, its parameters placed on a mesh with the run's layout (fsdp, tensor), its tokenizer.

Only the parameters are read (orbax partial restore), not the optimizer state, unless the
moving average of the parameters is asked for.
"""

import dataclasses
import os
import re
from typing import Any

import jax
import numpy as np

from disttrain import config as config_lib, models
from disttrain.config import Config, conditional
from disttrain.data import tokenizer as tokenizer_lib
from disttrain.errors import CheckpointError, ConfigError
from disttrain.hf import adapters, config as hf_config, weights as hf
from disttrain.models import lora
from disttrain.parallel import mesh as mesh_lib, optim, state as state_lib
from disttrain.storage import checkpoint_reads


@dataclasses.dataclass
class Trained:
  """What sampling and export need."""
  cfg: Config  # the run's config (for a Hugging Face directory: its model fields)
  model: Any  # disttrain.models.language_model.LanguageModel
  params: Any  # on `mesh`
  mesh: Any
  tokenizer: tokenizer_lib.Tokenizer
  source: str  # 'RUN_DIR step N' or the Hugging Face directory
  context: int  # the longest sequence it takes (positions table, max_seq_len or data.seq_len)
  adapters: Any = None  # a LoRA run's adapters (params holds them merged into the base)
  hf_dir: str = ''  # the Hugging Face directory it was read from (its generation_config.json)

  def stop_ids(self) -> tuple[int, ...]:
    """EOS and the model's own stop ids (an instruct model's end of turn)."""
    return self.tokenizer.stop_ids(self.model.cfg.vocab_size, self.hf_dir or None)


def _config(tree: dict, mesh: dict | None) -> Config:
  cd = config_lib.defaults()
  for group, fields in tree.items():
    if isinstance(fields, dict) and group in cd:
      cd[group].update({k: v for k, v in fields.items() if k in cd[group]})
    elif group in cd:
      cd[group] = tuple(tuple(r) for r in fields) if group.endswith('_rules') else fields
  if mesh:  # the whole layout: axes it does not name are 1 (data=-1 kept the run's fsdp x tensor)
    cd.mesh.update({axis: mesh.get(axis, 1) for axis in mesh_lib.AXES})
    cd.dcn_mesh.update(config_lib.defaults().dcn_mesh.to_dict())
  return config_lib.from_config_dict(_unused_cleared(cd))


def _unused_cleared(cd):
  """A saved run's fields that its run did not use, back at their defaults: configs saved before
  such fields were refused (lora.alpha without a rank, ...) load as the model they trained."""
  for path, _ in conditional.unused(cd):
    group, name = path.split('.')
    cd[group][name] = conditional.default(path)
  default, model = config_lib.defaults(), cd.model
  if model.name == 'gpt':  # the family built none of them (refused since: models/gpt.py)
    model.head_dim, model.rope_theta = default.model.head_dim, default.model.rope_theta
    model.rope_scaling.update(default.model.rope_scaling.to_dict())
  if model.name in ('gemma2', 'gemma3'):  # Gemma's own RMSNorm, whatever model.norm said
    model.norm = 'rmsnorm'
  cd.logical_rules = tuple(dict(cd.logical_rules).items())  # a name's last rule held
  return cd


def _mesh(cfg: Config, devices, given: bool = False):
  mesh, dcn = cfg.mesh, cfg.dcn_mesh
  if jax.process_count() == 1 and dcn.granules > 1:  # one process: the whole layout, flat
    mesh = dataclasses.replace(mesh, **{a: getattr(mesh, a) * getattr(dcn, a) for a in
                                        mesh_lib.AXES if getattr(mesh, a) != -1})
    dcn = None
  try:
    return mesh_lib.build(mesh, devices, dcn)
  except ConfigError as e:
    whose = 'the --mesh given' if given else 'the run was laid out on mesh'
    raise ConfigError(f'{e} ({whose} {dict(vars(cfg.mesh))}): pass --fake_devices=N to match '
                      'it on CPU, or --mesh=data=-1 to lay the model out on the devices '
                      'present') from None


def parse_mesh(text: str) -> dict[str, int] | None:
  """A CLI's --mesh: 'data=-1,fsdp=2' -> {'data': -1, 'fsdp': 2}; '' -> None."""
  if not text:
    return None
  out = {}
  for part in text.split(','):
    axis, eq, size = (p.strip() for p in part.partition('='))
    if not (eq and axis in mesh_lib.AXES and re.fullmatch(r'-?[0-9]+', size)):
      raise ConfigError(f'--mesh={text!r}: {part!r} is not AXIS=SIZE with AXIS one of '
                        f'{mesh_lib.AXES}; pass e.g. --mesh=data=-1')
    out[axis] = int(size)
  return out


def load(*, workdir: str = '', hf_dir: str = '', step: int | None = None, devices=None,
         mesh: dict | str | None = None, tokenizer: str | None = None, ema: bool = False,
         compute_dtype: str | None = None) -> Trained:
  """The model of `workdir` (latest checkpoint, or `step`) or of `hf_dir`, on a mesh of `devices`
  with the run's mesh and rules (`mesh` replaces the mesh: axes it does not name are 1, e.g.
  {'data': -1} or 'data=-1' for data parallelism over the devices present)."""
  mesh = parse_mesh(mesh) if isinstance(mesh, str) else mesh
  if bool(workdir) == bool(hf_dir):
    raise ConfigError('pass --workdir=RUN_DIR (a run with a checkpoint) or --hf_dir=DIR, one')
  if hf_dir and (step is not None or ema):  # a directory holds one set of weights
    raise ConfigError(f'--{"step" if step is not None else "ema"} picks among a run\'s '
                      'checkpoints; --hf_dir has one set of weights: leave it out, or pass '
                      '--workdir=RUN_DIR')
  if hf_dir:
    config, family = hf_config.read(hf_dir)
    model_fields = hf_config.model_fields(config, family)
    cfg = _config({'model': {k: v for k, v in model_fields.items() if k != 'rope_scaling'}},
                  mesh)
    cd = config_lib.defaults(cfg)
    cd.model.rope_scaling.update(model_fields.get('rope_scaling', {}))
    cfg = config_lib.from_config_dict(cd)
    has_own = any(os.path.isfile(os.path.join(hf_dir, n))
                  for n in ('tokenizer.json', 'tokenizer.model'))
    source, tok_path = hf_dir, tokenizer if tokenizer is not None else (hf_dir if has_own else '')
  else:
    tree, step = checkpoint_reads.run_config(workdir, step)
    cfg, source = _config(tree, mesh), f'{workdir} step {step}'
    tok_path = cfg.data.tokenizer if tokenizer is None else tokenizer
  dtype = compute_dtype or cfg.precision.compute_dtype
  model = models.build(cfg.model, dtype, cfg.row_tokens)
  if not hasattr(model, 'family'):
    raise ConfigError(f'model.name={cfg.model.name!r} is not a language model; sampling and '
                      "export take a language model (llama, qwen2, qwen3, gpt)")
  mesh_ = _mesh(cfg, devices, given=bool(mesh))
  context = model.cfg.learned_positions or cfg.model.max_seq_len or cfg.row_tokens
  spec = {'tokens': jax.ShapeDtypeStruct((1, cfg.data.seq_len), np.int32)}
  abstract = state_lib.abstract_params(model, spec, cfg, mesh_)
  found_adapters = None
  if hf_dir:
    params = hf.restore(hf_dir, model, cfg.model, abstract)
  elif cfg.lora.rank:  # the adapters merged into the base they were trained on
    if ema:
      raise ConfigError(f'{workdir} trained LoRA adapters; --ema reads full parameters, drop it')
    params, found_adapters = adapters.load_run(cfg, lora.adapt(model, cfg.lora), spec, mesh_,
                                               workdir, step)
  elif ema:
    params = _ema(workdir, step, cfg, model, spec, mesh_)
  else:
    params = checkpoint_reads.restore_subtree(workdir, step, {'params': abstract})['params']
  return Trained(cfg, model, params, mesh_, tokenizer_lib.load(tok_path), source, context,
                 found_adapters, hf_dir or '')


def _ema(workdir: str, step: int, cfg: Config, model, spec, mesh):
  """The moving average kept in the optimizer state (the whole state is read for it)."""
  if not cfg.ema_decay:
    raise CheckpointError(f'{workdir} was trained without ema_decay, so it keeps no moving '
                          'average; drop --ema')
  tx, _ = optim.build(cfg)
  lay = state_lib.layout(model, tx, spec, cfg, mesh, check=False)
  abstract = state_lib.abstract(lay, model, tx, spec, cfg.seed)
  restored = checkpoint_reads.restore_subtree(workdir, step, {'opt_state': abstract.opt_state})
  return optim.ema_params(restored['opt_state'])

"""Write a run's checkpoint as a Hugging Face model directory that `transformers` loads.

  disttrain export --workdir=RUN_DIR --out=HF_DIR [--step=N] [--dtype=bfloat16] [--ema]
  disttrain export --workdir=LORA_RUN_DIR --out=ADAPTER_DIR --adapter

OUT (a folder, or a gs:// / s3:// URL) gets what disttrain/hf/saves.py writes: config.json, the
weights as safetensors (split into files of at most --max_shard_gb, with an index, written one
tensor at a time) and the run's tokenizer with its chat template. Only the parameters are read
from the checkpoint, onto this host's first device. A LoRA run exports its adapters merged into
the base, or with --adapter as a PEFT adapter directory (disttrain/hf/adapters.py).
"""

import time

from absl import flags

from disttrain import commandline

_WORKDIR = flags.DEFINE_string('workdir', None, 'A run directory with a checkpoint.')
_OUT = flags.DEFINE_string('out', None, 'The Hugging Face directory to write (created).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Weights dtype.')
_EMA = flags.DEFINE_bool('ema', False, 'Export the moving average of the parameters.')
_MAX_SHARD_GB = flags.DEFINE_float('max_shard_gb', 2.0, 'Largest safetensors file, GiB.')
_ADAPTER = flags.DEFINE_bool('adapter', False, 'A LoRA run: write its adapters as a PEFT '
                             'directory (adapter_config.json + adapter_model.safetensors).')
flags.mark_flags_as_required(['workdir', 'out'])


def export(workdir: str, out: str, step: int | None = None, dtype: str = 'float32',
           ema: bool = False, max_shard_bytes: int = 2 * 2**30, adapter: bool = False) -> str:
  """Writes the model of `workdir` to `out`; returns a one-line summary."""
  import jax  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from disttrain.errors import ConfigError
  from disttrain.hf import adapters, exported_config, families, saves, trained
  from disttrain.parallel import mesh
  start = time.perf_counter()
  lm = trained.load(workdir=workdir, step=step, devices=jax.devices()[:1], ema=ema,
                    mesh={axis: 1 for axis in mesh.AXES})
  family = lm.model.family
  exported_config.check_exportable(lm.model, workdir)
  if adapter:
    if lm.adapters is None:
      raise ConfigError(f'{workdir} trained every weight (lora.rank=0): it has no adapters; '
                        'drop --adapter to export the model')
    names = adapters.write_peft(out, family, lm.cfg, lm.adapters, dtype=dtype)
    return (f'exported the LoRA adapters of {lm.source} (rank {lm.cfg.lora.rank}, '
            f'{len(names)} tensors, {dtype}) to {out} as a PEFT adapter directory, in '
            f'{time.perf_counter() - start:.1f}s')
  files, size, copied = saves.write(out, family, lm.cfg.model, lm.model.cfg, lm.params,
                                    lm.tokenizer, lm.context, dtype, max_shard_bytes)
  return (f'exported {lm.source} ({families.FAMILIES[family]}, {dtype}'
          f'{", EMA" if ema else ""}) to {out}: {len(files)} safetensors file(s), '
          f'{size / 2**20:,.1f} MiB, tokenizer {copied or "none (bytes)"}, in '
          f'{time.perf_counter() - start:.1f}s')


def main(argv) -> None:
  if len(argv) > 1:
    commandline.fail(f'unexpected arguments {argv[1:]}; pass settings as flags, e.g. '
                     '--workdir=RUN_DIR')
  commandline.output_dir('out', _OUT.value)
  if not _MAX_SHARD_GB.value > 0:
    commandline.fail(f'--max_shard_gb={_MAX_SHARD_GB.value:g} must be > 0: the largest '
                     'safetensors file, in GiB; pass e.g. --max_shard_gb=2')
  if _ADAPTER.value and _MAX_SHARD_GB.present:  # PEFT reads one adapter_model.safetensors
    commandline.fail('--max_shard_gb splits a model\'s safetensors; --adapter writes one '
                     'adapter_model.safetensors, as PEFT reads it: drop --max_shard_gb')
  from disttrain.errors import DisttrainError  # pylint: disable=g-import-not-at-top
  try:
    print(export(_WORKDIR.value, _OUT.value, _STEP.value, _DTYPE.value, _EMA.value,
                 int(_MAX_SHARD_GB.value * 2**30), _ADAPTER.value), flush=True)
  except DisttrainError as e:
    commandline.fail(f'{type(e).__name__}: {e}')



if __name__ == '__main__':
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)  # orbax's info and read-only notes
  commandline.run(main)

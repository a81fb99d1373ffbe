"""The Hugging Face world and sampling: weights and config.json in and out, trained models.

  weights      the one place that knows Hugging Face tensor names and layouts
  families     the architectures mapped to families, and each family's config.json defaults
  config       Hugging Face config.json: read, checked against the model fields, turned into them
  gemma_config Gemma 2/3's own config.json parts (layer pattern, local rotary base, caps)
  exported_config  what an export can hold, and the config.json it writes
  tensorfiles  safetensors read (memory-mapped) and written one tensor at a time
  trained      a run's (or a Hugging Face directory's) model for sampling and export, on a mesh
  generate     prefill + KV-cache decoding in one compiled loop; `disttrain generate`
  export       `disttrain export`: a checkpoint as a Hugging Face directory
The weight functions are also this package's names (`disttrain.hf.is_hf_dir`), as before.
"""

from disttrain import moved

_EXPORTS = {name: 'weights' for name in (
    'TABLES', 'Tensor', 'export_tensors', 'is_hf_dir', 'load_params', 'restore')}
__all__ = sorted(_EXPORTS)
__getattr__ = moved.names(__name__, _EXPORTS)

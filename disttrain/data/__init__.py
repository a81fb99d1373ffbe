"""Examples in, global batches out: the data layer (below the mesh, the models and the step).

  records     any source of feature dicts -> Records: element spec, checks, transforms with
              (seed, epoch, index) randomness, batched reads
  fields      the checks each field passes: numeric, fits JAX's 32-bit dtype, one length
  formats     on-disk formats: ArrayRecord shards of encoded dicts, flat token files
  text        raw text as random-access documents (.txt, .jsonl, .parquet), SFT examples
  tokenizer   tokenizer.json / SentencePiece / bytes; `disttrain tokenizer` trains a BPE
  packing     tokenize once into token files; concat windows, best-fit document packing
  schedule    which source each row of a mixture comes from (a smooth weighted round robin)
  mixture     data.mixture: weighted, staged sources whose rows resume exactly
  in_memory   the built-in sets held as numpy arrays: digits, mnist, synthetic, text
  sources     data.name -> the train and eval sources a config names
  transforms  example grain transformations for images
  global_arrays  a process's rows of a global batch -> global jax.Arrays (the Assembler)
  batches     the grain stream of per-process rows, assembled on a batch sharding; eval batches
  workers     what data.workers=N needs: room on the machine, a main script workers can import
  convert     `disttrain convert`: datasets to ArrayRecord shards, token files, JSON lines
The names below are the layer's public API, imported on first use (they were disttrain.data's).
"""

from disttrain import moved

_EXPORTS = {
    'Batch': 'global_arrays', 'TrainIterator': 'batches',
    'check_workers': 'workers', 'element_spec': 'batches', 'eval_batches': 'batches',
    'local_rows': 'global_arrays', 'stacked_sharding': 'global_arrays',
    'Data': 'records', 'ID': 'records', 'MASK': 'records', 'RESERVED': 'records',
    'Mixture': 'mixture',
    'Records': 'records',
    'array_record_source': 'formats', 'decode': 'formats', 'encode': 'formats',
    'write_array_record': 'formats', 'write_tokens': 'formats',
}
__all__ = sorted(_EXPORTS)
__getattr__ = moved.names(__name__, _EXPORTS)

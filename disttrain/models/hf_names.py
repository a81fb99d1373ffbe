"""How a family's parameters are named and laid out in Hugging Face checkpoints.

Each family's module lists its parameters as `Tensor`s (HF_NAMES: family -> list) next to its
config -> decoder mapping; disttrain/hf/weights.py reads and writes checkpoints from those lists
alone (one tensor at a time, layers stacked on our leading axis). A name's '{i}' is the layer of
a scanned block weight, '{j}' the expert of a mixture-of-experts weight.
"""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tensor:
  """How one of our parameters maps to a Hugging Face tensor.

  kind: 'linear' (torch [out, in]), 'conv1d' (GPT-2's [in, out]), 'flat' (the same values in
  another shape), 'embedding' ([V, D], rows padded), 'lm_head' (torch [V, D] of our [D, V]).
  n_in: how many of our leading dimensions are the layer's input (linear, conv1d).
  """
  ours: str
  hf: str  # '{i}': the layer of a scanned block weight; '{j}': the expert
  kind: str = 'flat'
  n_in: int = 1

  def hf_shape(self, ours: tuple, vocab: int) -> tuple:
    if self.kind == 'embedding':
      return (vocab, ours[1])
    if self.kind == 'lm_head':
      return (vocab, ours[0])
    if self.kind in ('linear', 'conv1d'):
      io = (math.prod(ours[:self.n_in]), math.prod(ours[self.n_in:]))
      return io[::-1] if self.kind == 'linear' else io
    return (math.prod(ours),) if len(ours) > 1 and self.hf.endswith('bias') else ours

  def to_ours(self, x: np.ndarray, ours: tuple) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if self.kind == 'embedding':
      return np.pad(x, ((0, ours[0] - x.shape[0]), (0, 0)))
    if self.kind == 'lm_head':
      return np.pad(x.T, ((0, 0), (0, ours[1] - x.shape[0])))
    return (x.T if self.kind == 'linear' else x).reshape(ours)

  def to_hf(self, x: np.ndarray, vocab: int) -> np.ndarray:
    if self.kind == 'embedding':
      return x[:vocab]
    if self.kind == 'lm_head':
      return x[:, :vocab].T
    shape = self.hf_shape(x.shape, vocab)
    return x.reshape(shape[::-1]).T if self.kind == 'linear' else x.reshape(shape)



def llama_layout(qkv_bias: bool = False, qk_norm: bool = False,
                 experts: tuple | None = None) -> list[Tensor]:
  """Llama's names, the base of the families built on its decoder: Qwen2 adds the query, key and
  value biases, Qwen3 the per-head norms; `experts` (the block's module, its experts' names for
  our gate, up and down) replaces the MLP with a router and one tensor per expert."""
  layer = 'model.layers.{i}.'
  projections = (('query', 'q'), ('key', 'k'), ('value', 'v'))
  extra = [Tensor(f'blocks/attention/{ours}/bias', f'{layer}self_attn.{hf}_proj.bias')
           for ours, hf in projections if qkv_bias]
  extra += [Tensor(f'blocks/attention/{ours}_norm/scale', f'{layer}self_attn.{hf}_norm.weight')
            for ours, hf in projections[:2] if qk_norm]
  mlp = [Tensor(f'blocks/mlp/{name}/kernel', f'{layer}mlp.{name}_proj.weight', 'linear')
         for name in ('gate', 'up', 'down')]
  if experts:
    module, names = experts
    mlp = [Tensor('blocks/moe/router/kernel', f'{layer}{module}.gate.weight', 'linear'),
           *(Tensor(f'blocks/moe/{ours}', f'{layer}{module}.experts.{{j}}.{hf}.weight', 'linear')
             for ours, hf in zip(('gate', 'up', 'down'), names))]
  return [Tensor('embed', 'model.embed_tokens.weight', 'embedding'),
          *extra,
          Tensor('blocks/attention_norm/scale', layer + 'input_layernorm.weight'),
          *(Tensor(f'blocks/attention/{ours}/kernel', f'{layer}self_attn.{hf}_proj.weight',
                   'linear') for ours, hf in projections),
          Tensor('blocks/attention/out/kernel', layer + 'self_attn.o_proj.weight', 'linear', 2),
          Tensor('blocks/mlp_norm/scale', layer + 'post_attention_layernorm.weight'),
          *mlp,
          Tensor('final_norm/scale', 'model.norm.weight'),
          Tensor('unembed/kernel', 'lm_head.weight', 'lm_head')]

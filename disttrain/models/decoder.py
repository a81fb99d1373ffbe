"""The decoder-only transformer every language model here is (GPT-2, Llama, Qwen, Mistral, Gemma
and the MoE families); language_model.py puts it on disttrain's model protocol.

  tokens [B, T] -> embed (+ learned positions) -> L x block -> norm -> logits [B, T, V]
  block: x + attention(norm(x)); x + mlp(norm(x))

The blocks are one `nn.scan` over a leading 'layers' axis of every block weight, so a model of
any depth compiles as fast as one block; `scan_unroll` blocks per scan iteration trade compile
time for XLA's freedom to schedule across a block boundary (overlap one block's weight gathers
with the last one's compute). `remat` wraps the block in `nn.remat` with a jax.checkpoint policy
('full' saves nothing; 'minimal' and 'save_attention_out' keep activations layers.py names).
Packed rows carry `segment_ids` (tokens attend only inside their own document) and `positions`
(restarting per document). The vocabulary is padded to a multiple of `vocab_multiple` (GPT-2's
50,257 -> 50,304) so it splits evenly; padded ids get a logit of -1e9, so they carry no
probability. `dtype` is the activations' compute dtype; the parameters stay float32. Decoding
passes a KV cache through the layers (generate.py); it is an argument and a result, never a Flax
collection, so it never reaches a checkpoint.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from disttrain import moved
from disttrain.errors import ConfigError
from disttrain.models import chunked_loss, float8, layers, moe, pipeline
from disttrain.models.layers import Decode, constrain, weights
from disttrain.models.linen import LOSSES
from disttrain.parallel import sharding

# Names that moved to another module resolve there, with a DeprecationWarning.
__getattr__ = moved.names(__name__, {})


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """One family's choices (gpt.py and llama.py build these from the run's model config)."""
  vocab_size: int
  width: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  mlp_dim: int
  mlp: str  # 'gelu' or 'swiglu'
  norm: str  # 'layernorm' or 'rmsnorm'
  norm_eps: float
  use_bias: bool
  fused_qkv: bool
  learned_positions: int  # table rows (GPT-2's n_positions); 0 = rotary embeddings instead
  rope: tuple | None  # inverse frequencies, or None
  tied_embeddings: bool
  dropout: float = 0.0
  remat: str = 'none'
  scan_unroll: int = 1  # layers per iteration of the layer scan (model.scan_unroll)
  attention: str = 'auto'
  attention_block: int = 512
  dtype: Any = jnp.float32
  vocab_multiple: int = 128
  num_experts: int = 0  # > 0: mixture-of-experts feed-forward layers (disttrain/models/moe.py)
  experts_per_token: int = 2
  expert_capacity: float = 1.25
  router_aux_weight: float = 0.01
  router_z_weight: float = 0.001
  router_balance: str = 'switch'  # or 'transformers' (moe.py)
  moe_norm_topk: bool = True
  head_size: int = 0  # features per head; 0 = width / num_heads
  qkv_bias: bool = False  # biases on the query, key and value projections alone (Qwen2)
  qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
  sliding_window: int = 0  # attend to the last N positions only; 0 = all (Mistral)
  loss_chunk: int = 0  # cross-entropy chunk in tokens: 0 auto, -1 never (chunked_loss.py)
  # Gemma (disttrain/models/gemma.py): embeddings x sqrt(width), norms after attention and the
  # MLP too, the attention's scale and logit cap, the final logits' cap, and per-layer windows
  # (0 = global) with their own rotary frequencies, still one scan.
  embed_scale: bool = False
  sandwich_norms: bool = False
  query_scale: float = 0.0
  attn_softcap: float = 0.0
  final_softcap: float = 0.0
  layer_windows: tuple = ()
  local_rope: tuple | None = None
  lora: Any = None  # lora.LoraSpec: low-rank adapters on the projections it targets (lora.py)
  matmul: str = 'default'  # 'float8': the blocks' dense projections in float8 (float8.py)

  @property
  def head_dim(self) -> int:
    return self.head_size or self.width // self.num_heads

  @property
  def padded_vocab(self) -> int:
    return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


class Block(nn.Module):
  """One pre-norm block; (x, shared, layer cache) -> (x, new layer cache) for nn.scan."""
  cfg: DecoderConfig
  train: bool

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, segments_BxT, decode, cache, window=None):
    cfg = self.cfg
    dropout = nn.Dropout(cfg.dropout, deterministic=not self.train)
    dot_general = float8.dot_general if cfg.matmul == 'float8' else None
    h = layers.norm(cfg.norm, cfg.norm_eps, cfg.dtype, 'attention_norm')(x_BxTxD)
    attended, cache = layers.Attention(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.use_bias, cfg.fused_qkv, cfg.dtype,
        rope=cfg.rope, implementation=cfg.attention, block_size=cfg.attention_block,
        qkv_bias=cfg.use_bias or cfg.qkv_bias, qk_norm_eps=cfg.norm_eps if cfg.qk_norm else 0.0,
        window=cfg.sliding_window, qk_norm_offset=cfg.norm == 'offset_rmsnorm',
        query_scale=cfg.query_scale, softcap=cfg.attn_softcap, local_rope=cfg.local_rope,
        lora=cfg.lora, dot_general=dot_general,
        name='attention')(h, positions_BxT, segments_BxT, decode, cache, window)
    if cfg.sandwich_norms:
      attended = layers.norm(cfg.norm, cfg.norm_eps, cfg.dtype, 'post_attention_norm')(attended)
    x_BxTxD = constrain(x_BxTxD + dropout(attended), ('batch', 'sequence', None))
    h = layers.norm(cfg.norm, cfg.norm_eps, cfg.dtype, 'mlp_norm')(x_BxTxD)
    if cfg.num_experts:
      h = moe.MoeMlp(cfg.num_experts, cfg.experts_per_token, cfg.expert_capacity, cfg.mlp,
                     cfg.mlp_dim, cfg.dtype, cfg.router_aux_weight, cfg.router_z_weight,
                     cfg.moe_norm_topk, cfg.router_balance,
                     name='moe')(h, None if segments_BxT is None else segments_BxT > 0)
    else:
      h = layers.Mlp(cfg.mlp, cfg.mlp_dim, cfg.use_bias, cfg.dtype, lora=cfg.lora,
                     dot_general=dot_general, name='mlp')(h)
    if cfg.sandwich_norms:
      h = layers.norm(cfg.norm, cfg.norm_eps, cfg.dtype, 'post_mlp_norm')(h)
    return constrain(x_BxTxD + dropout(h), ('batch', 'sequence', None)), cache


class Unembed(nn.Module):
  """The untied unembedding kernel [D, V] (the params path of the nn.Dense it replaces)."""
  width: int
  vocab: int

  @nn.compact
  def __call__(self) -> jax.Array:
    return self.param('kernel', weights(('embed', 'vocab')), (self.width, self.vocab))


# Policies over the block's named activations (layers.py), MaxText's 'minimal' and
# 'save_dot_with_context_except_mlp'; config.REMAT says what each saves and recomputes.
_NAMED_POLICIES = {
    'minimal': layers.QKV_PROJ + (layers.OUT_PROJ, layers.MLP_IN, layers.MLP_OUT),
    'save_attention_out': layers.QKV_PROJ + (layers.CONTEXT, layers.OUT_PROJ),
}


def resolve_remat(remat: str) -> str:
  """model.remat with 'auto' made concrete: on XLA:CPU a scan keeping every activation writes
  each layer's intermediates to memory, slower than recomputing the elementwise ones
  (docs/performance.md)."""
  if remat != 'auto':
    return remat
  return 'dots_saveable' if jax.default_backend() == 'cpu' else 'none'


def _remat_policy(remat: str):
  """The jax.checkpoint policy of model.remat (not 'none'): None saves nothing ('full')."""
  if remat in _NAMED_POLICIES:
    return jax.checkpoint_policies.save_only_these_names(*_NAMED_POLICIES[remat])
  return None if remat == 'full' else getattr(jax.checkpoint_policies, remat)


class Decoder(nn.Module):
  """Token ids [B, T] -> next-token logits [B, T, padded vocab] (float32, padding at -1e9).

  With `cache` (init_cache's layout) and `decode`, returns (logits, new cache) instead; with
  `features` and a chunked loss (model.loss_chunk), chunked_loss.Features instead of logits.
  """
  cfg: DecoderConfig

  @nn.compact
  def __call__(self, tokens_BxT: jax.Array, train: bool = False, *, positions=None,
               segment_ids=None, decode: Decode | None = None, cache=None, features=False):
    cfg = self.cfg
    b, t = tokens_BxT.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    embedding_VxD = self.param('embed', weights(('vocab', 'embed')), (cfg.padded_vocab, cfg.width))
    x_BxTxD = jnp.take(embedding_VxD, tokens_BxT, axis=0)
    if cfg.learned_positions:
      table = self.param('positions', weights((None, 'embed'), nn.initializers.normal(0.01)),
                         (cfg.learned_positions, cfg.width))
      x_BxTxD = x_BxTxD + jnp.take(table, positions, axis=0)
    if cfg.embed_scale:
      x_BxTxD = x_BxTxD * jnp.asarray(np.sqrt(cfg.width), x_BxTxD.dtype)
    x_BxTxD = constrain(x_BxTxD.astype(cfg.dtype), ('batch', 'sequence', None))
    x_BxTxD = nn.Dropout(cfg.dropout, deterministic=not train)(x_BxTxD)
    block = Block
    if cfg.remat != 'none' and decode is None:  # sampling never differentiates (nor takes Decode)
      block = nn.remat(Block, policy=_remat_policy(cfg.remat), prevent_cse=False)
    # Sown per-layer values (router losses, dropped choices) stack over layers like the weights.
    blocks = nn.scan(block, variable_axes={'params': 0, LOSSES: 0, moe.MOE: 0},
                     split_rngs={'params': True, 'dropout': True},
                     in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0, 0),
                     length=cfg.num_layers, unroll=cfg.scan_unroll,
                     metadata_params={nn.PARTITION_NAME: 'layers'})
    split = sharding.pipeline_split()
    windows = jnp.asarray(cfg.layer_windows, jnp.int32) if cfg.layer_windows else None
    if split is not None and windows is not None:
      raise ConfigError('a model whose layers differ (local and global attention) cannot be '
                        'split over mesh.stage yet; set mesh.stage=1')
    if split is not None and decode is None and not self.is_initializing():
      def layer(params, h, positions, segment_ids):  # one block, unbound: its weights passed in
        return Block(cfg, train, parent=None).apply({'params': params}, h, positions,
                                                    segment_ids, None, None)[0]
      if cfg.remat != 'none':  # per layer, as nn.remat(Block) in the scan
        layer = jax.checkpoint(layer, policy=_remat_policy(cfg.remat), prevent_cse=False)
      x_BxTxD = pipeline.run(layer, self.variables['params']['blocks'], x_BxTxD,
                             (positions, segment_ids), *split)
    else:
      x_BxTxD, cache = blocks(cfg, train, name='blocks')(x_BxTxD, positions, segment_ids, decode,
                                                        cache, windows)
    x_BxTxD = layers.norm(cfg.norm, cfg.norm_eps, cfg.dtype, 'final_norm')(x_BxTxD)
    unembed = embedding_VxD if cfg.tied_embeddings else Unembed(cfg.width, cfg.padded_vocab,
                                                                name='unembed')()
    chunk = chunked_loss.chunk_tokens(cfg.loss_chunk, t, cfg.padded_vocab)
    if features and chunk and decode is None:
      return chunked_loss.Features(x_BxTxD, unembed, cfg.vocab_size, cfg.tied_embeddings, chunk,
                                   cfg.dtype, cfg.final_softcap)
    logits_BxTxV = chunked_loss.logits(x_BxTxD, unembed, cfg.tied_embeddings, cfg.vocab_size,
                                       cfg.dtype, cfg.final_softcap)
    return logits_BxTxV if decode is None else (logits_BxTxV, cache)

  def init_cache(self, batch: int, length: int) -> dict:
    """Zeros {'k', 'v': [L, B, S, G, K]} in the compute dtype (call unbound: it uses cfg only)."""
    cfg = self.cfg
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    return {'k': jnp.zeros(shape, cfg.dtype), 'v': jnp.zeros(shape, cfg.dtype)}

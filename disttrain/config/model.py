"""model.* and precision.*: which model, its hyper-parameters, the dtypes it computes in."""

import dataclasses

from disttrain.config.checks import one_of, positive
from disttrain.errors import ConfigError

REMAT = ('auto', 'none', 'full', 'minimal', 'save_attention_out', 'dots_saveable',
         'dots_with_no_batch_dims_saveable', 'everything_saveable')
ATTENTION = ('auto', 'xla', 'cudnn', 'blockwise')
ROUTER_BALANCE = ('switch', 'transformers')  # model.router_balance: the balancing loss's form


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
  """Rotary frequency scaling (config.json rope_scaling): Llama 3's ('llama3') or linear (every
  frequency / factor: Gemma 3's global layers beyond 1B)."""
  kind: str = ''  # '' = none, 'llama3' or 'linear'
  factor: float = 8.0  # how much longer the context is than original_max_len
  low_freq_factor: float = 1.0  # wavelengths above original_max_len / this are scaled by factor
  high_freq_factor: float = 4.0  # wavelengths below original_max_len / this are kept
  original_max_len: int = 8192  # original_max_position_embeddings

  def __post_init__(self):
    one_of('model.rope_scaling.kind', self.kind, ('', 'llama3', 'linear'))
    positive('model.rope_scaling.factor', self.factor)
    positive('model.rope_scaling.original_max_len', self.original_max_len)
    if self.kind == 'llama3' and not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ConfigError(f'model.rope_scaling: low_freq_factor={self.low_freq_factor} must be > 0 '
                        f'and below high_freq_factor={self.high_freq_factor}')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Which model and its hyper-parameters. A field keeps one meaning in every family that
  reads it; its comment names the families that read it."""
  # A builder in disttrain.models.MODELS: mnist_mlp, bobbin_mlp, nnx_mlp, jax_mlp, keras_mlp
  # (needs the keras extra), gpt, llama, qwen2, qwen3, mistral, char_lm (deprecated: the gpt); or
  # hf: the family and every model field from restore_from's config.json (launch/configs/hf.py).
  name: str = 'mnist_mlp'
  hidden: int = 512  # MLP width / transformer width
  dropout: float = 0.3  # rate; 0 disables dropout
  num_layers: int = 2  # transformer blocks
  num_heads: int = 4  # attention heads; must divide model.hidden
  # Transformer MLP width; 0 = the family's default (gpt 4 x hidden, llama 8/3 x hidden rounded
  # up to 256).
  mlp_dim: int = 0
  num_classes: int = 10  # classifiers' outputs
  vocab_size: int = 256  # language models' vocabulary (256 = bytes)
  input_key: str = ''  # batch field the model reads; '' = the model's default (image, tokens)
  target_key: str = ''  # batch field the task learns; '' = the model's default (label, targets)
  # Transformer blocks' rematerialisation: what the backward pass keeps from the forward pass.
  #   auto: dots_saveable on CPUs (1.2-1.5x none's tokens/s there), none on GPUs and TPUs.
  #   none: keeps every activation; recomputes nothing.
  #   full: keeps each block's input; recomputes the whole block.
  #   minimal: keeps every projection's output (q, k, v, out, MLP in and out); recomputes norms,
  #     RoPE, attention (logits, softmax, context) and the MLP activation (MaxText's minimal).
  #   save_attention_out: keeps q, k, v, attention's output and its projection; recomputes norms
  #     and the whole MLP (its two input matmuls).
  #   dots_saveable, dots_with_no_batch_dims_saveable, everything_saveable: the
  #     jax.checkpoint_policies of those names.
  remat: str = 'auto'
  # Transformer blocks per iteration of the layer scan: more lets XLA overlap across blocks and
  # costs compile time; need not divide model.num_layers (the rest run unrolled after the loop).
  # The pipelined layers (mesh.stage > 1) are not unrolled.
  scan_unroll: int = 1
  tied_embeddings: bool = True  # language models: the unembedding is the token embedding's T
  norm: str = ''  # gpt: layernorm (default) or rmsnorm; llama: rmsnorm
  num_kv_heads: int = 0  # llama, qwen: K/V heads shared by groups of query heads; 0 = num_heads
  # llama, qwen: features per attention head; 0 = model.hidden / model.num_heads (Qwen3 and some
  # Llamas set it apart from the width).
  head_dim: int = 0
  # llama, qwen, mistral: each token attends to the last N positions (itself included); 0 = all
  # (Mistral 7B v0.1: 4096).
  sliding_window: int = 0
  rope_theta: float = 10000.0  # llama: rotary embedding base
  # gemma: every Nth layer attends globally, the others to model.sliding_window positions; 0 =
  # every layer alike (Gemma 2: 2, Gemma 3: 6).
  sliding_window_pattern: int = 0
  local_rope_theta: float = 0.0  # gemma3: the local layers' rotary base; 0 = model.rope_theta
  query_pre_attn_scalar: float = 0.0  # gemma: attention logits x this^-1/2; 0 = head size
  attn_softcap: float = 0.0  # gemma2: attention logits capped at c tanh(x / c); 0 = none
  final_softcap: float = 0.0  # gemma2: output logits capped at c tanh(x / c); 0 = none
  rope_scaling: RopeScalingConfig = RopeScalingConfig()
  norm_eps: float = 1e-5  # language models' LayerNorm / RMSNorm epsilon
  # gpt: rows of the learned positions table; sampling's context; 0 = data.seq_len.
  max_seq_len: int = 0
  attention: str = 'auto'  # auto, xla, cudnn, blockwise (disttrain/models/attention.py)
  attention_block: int = 512  # blockwise attention: query and key block length
  num_experts: int = 0  # language models: experts per mixture-of-experts layer; 0 = dense MLP
  experts_per_token: int = 2  # MoE: experts each token is routed to (top k)
  # MoE: slots per expert per row = this x T k / E (at most T; 0 = T, dropless); choices beyond
  # are dropped and reported as moe_dropped. -1 here and in router_aux_weight / router_z_weight
  # with model.name='hf': as the directory's config.json trains (dropless; router losses as
  # transformers adds them).
  expert_capacity: float = 1.25
  router_aux_weight: float = 0.01  # MoE: weight of the load-balancing loss (Switch)
  router_z_weight: float = 0.001  # MoE: weight of the router z-loss (ST-MoE)
  # MoE: the balancing loss's form: 'switch' (per layer, summed over layers: MaxText's, about 1 a
  # layer at balance) or 'transformers' (pooled over layers, each of the k choices counted:
  # about k at balance; what an imported model's router_aux_loss_coef weighs); '' with
  # model.name='hf': the directory's (transformers).
  router_balance: str = 'switch'
  # MoE: the k chosen experts' router probabilities renormalised to sum to 1 (Mixtral, Qwen3-MoE's
  # norm_topk_prob=true); False keeps their shares of the softmax over all experts.
  moe_norm_topk: bool = True
  # Language models: the cross-entropy's chunk in tokens, so the [B, T, V] logits are never held
  # whole (disttrain/models/chunked_loss.py); 0 = auto (chunks of <= 64 MiB of logits per row
  # once a row's logits exceed 128 MiB), -1 = never. run.json's `loss` says what was picked.
  loss_chunk: int = 0

  def __post_init__(self):
    positive('model.hidden', self.hidden)
    positive('model.num_layers', self.num_layers)
    positive('model.num_heads', self.num_heads)
    positive('model.mlp_dim', self.mlp_dim, allow_zero=True)
    positive('model.num_classes', self.num_classes)
    positive('model.vocab_size', self.vocab_size)
    one_of('model.remat', self.remat, REMAT)
    positive('model.scan_unroll', self.scan_unroll)
    one_of('model.norm', self.norm, ('', 'layernorm', 'rmsnorm'))
    positive('model.num_kv_heads', self.num_kv_heads, allow_zero=True)
    positive('model.rope_theta', self.rope_theta)
    positive('model.norm_eps', self.norm_eps)
    positive('model.max_seq_len', self.max_seq_len, allow_zero=True)
    positive('model.head_dim', self.head_dim, allow_zero=True)
    positive('model.sliding_window', self.sliding_window, allow_zero=True)
    for name in ('sliding_window_pattern', 'local_rope_theta', 'query_pre_attn_scalar',
                 'attn_softcap', 'final_softcap'):
      positive(f'model.{name}', getattr(self, name), allow_zero=True)
    if self.loss_chunk < -1:
      raise ConfigError(f'model.loss_chunk={self.loss_chunk}: set tokens per chunk (> 0), 0 for '
                        'auto or -1 for the whole sequence at once')
    one_of('model.attention', self.attention, ATTENTION)
    positive('model.attention_block', self.attention_block)
    positive('model.num_experts', self.num_experts, allow_zero=True)
    positive('model.experts_per_token', self.experts_per_token)
    for name in ('expert_capacity', 'router_aux_weight', 'router_z_weight'):
      if not (self.name == 'hf' and getattr(self, name) == -1):  # -1: the directory's
        positive(f'model.{name}', getattr(self, name), allow_zero=True)
    if not (self.name == 'hf' and self.router_balance == ''):  # '': the directory's
      one_of('model.router_balance', self.router_balance, ROUTER_BALANCE)
    if self.num_experts and self.experts_per_token > self.num_experts:
      raise ConfigError(f'model.experts_per_token={self.experts_per_token} > model.num_experts='
                        f'{self.num_experts}: a token picks distinct experts; use at most '
                        f'{self.num_experts}')
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f'model.dropout={self.dropout} must be in [0, 1); pass a rate in [0, 1) '
                        '(0 disables dropout)')


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  """Mixed precision: float32 master parameters, forward and backward in compute_dtype."""
  compute_dtype: str = 'float32'  # float32 or bfloat16
  param_dtype: str = 'float32'  # parameters and optimizer state (the master copy)
  # default, or float8: the decoder blocks' attention and MLP projections multiply in float8
  # with per-tensor current scaling (e4m3 forward, e5m2 gradients; disttrain/models/float8.py);
  # embeddings, output head and experts stay in compute_dtype. Needs bfloat16, step_mode=jit.
  matmul: str = 'default'

  def __post_init__(self):
    one_of('precision.compute_dtype', self.compute_dtype, ('float32', 'bfloat16'))
    one_of('precision.param_dtype', self.param_dtype, ('float32',))
    one_of('precision.matmul', self.matmul, ('default', 'float8'))
    if self.matmul == 'float8' and self.compute_dtype != 'bfloat16':
      raise ConfigError(f"precision.matmul='float8' runs beside bfloat16 activations, got "
                        f"precision.compute_dtype={self.compute_dtype!r}; set "
                        "precision.compute_dtype='bfloat16'")

"""Typed, frozen run config; validated when built, unknown fields rejected, one-line errors.

The dataclasses below are the single schema. `defaults()` turns them into a locked
`ml_collections.ConfigDict` for config files and `--config.<field>=<value>` overrides (a locked
ConfigDict rejects unknown fields); `from_config_dict` turns the result back into a validated
`Config`.
"""

import copy
import dataclasses
import math
import re
import sys
import typing
from typing import Any

import ml_collections

from disttrain.errors import ConfigError

SHARDINGS = ('replicate', 'fsdp')
STEP_MODES = ('jit', 'shard_map', 'pmap')
# Sources that read data.train_files.
FILE_SOURCES = ('array_record', 'tokens', 'documents', 'sft', 'preference', 'prompts')
PACKING = ('concat', 'documents')
MIXABLE = ('array_record', 'tokens', 'documents', 'sft')  # sources data.mixture can join
TOKEN_DTYPES = ('uint16', 'uint32')
REMAT = ('auto', 'none', 'full', 'minimal', 'save_attention_out', 'dots_saveable',
         'dots_with_no_batch_dims_saveable', 'everything_saveable')
OPTIMIZERS = ('adam', 'adamw', 'sgd', 'adafactor', 'lion', 'muon')
ATTENTION = ('auto', 'xla', 'cudnn', 'blockwise')
LR_SCHEDULES = ('constant', 'cosine', 'linear', 'wsd')


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ConfigError(f'{name}={value!r} is not one of {allowed}; pick one of them')


def _positive(name: str, value: int | float, allow_zero: bool = False) -> None:
  if value < 0 or (value == 0 and not allow_zero):
    bound = '>= 0' if allow_zero else '> 0'
    raise ConfigError(f'{name}={value!r} must be {bound}; pass a value {bound}')


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape, one size per axis (disttrain/parallel/mesh.py says what each is for); at
  most one axis may be -1, the devices left over. Their product is the number of devices."""
  data: int = -1  # data parallelism: each slice of the batch on its own replica of the state
  # Pipeline stages: a language model's layers split into this many stages (it must divide
  # model.num_layers); grad_accum_steps >= it are the micro-batches; step_mode=jit.
  stage: int = 1
  fsdp: int = 1  # splits the batch, and with sharding=fsdp each large parameter and its state
  # Splits mixture-of-experts experts (it must divide model.num_experts), and the batch elsewhere;
  # step_mode=jit.
  expert: int = 1
  # Context parallelism: splits each sequence's positions (language models; it must divide
  # data.seq_len); step_mode=jit.
  context: int = 1
  tensor: int = 1  # tensor parallelism: the dimensions param_rules / logical_rules map to 'tensor'

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    if list(sizes.values()).count(-1) > 1:
      raise ConfigError(f'mesh {sizes} has more than one -1 axis; give at most one axis -1 (fill)')
    for axis, size in sizes.items():
      if size != -1 and size < 1:
        raise ConfigError(f'mesh.{axis}={size} must be >= 1 or -1 (fill); set it to a positive '
                          'size or -1')


# The axes' names, outermost first; parallel/mesh.py's Parallelism spells each role.
MESH_AXES = tuple(f.name for f in dataclasses.fields(MeshConfig))
# Axes whose collectives run in every layer (activations): across slices or nodes they are slow.
LAYER_AXES = ('expert', 'context', 'tensor')


@dataclasses.dataclass(frozen=True)
class DcnMeshConfig:
  """Axis sizes across slices (TPU: devices' slice_index) or, elsewhere, across processes (each
  process a granule): the whole mesh is mesh.<axis> x dcn_mesh.<axis>, mesh.* within each
  granule on its fastest links (parallel/mesh.py). Default 1: one granule, a flat mesh."""
  data: int = 1  # data parallelism across slices or processes (the usual choice)
  stage: int = 1  # pipeline stages across them (one activation send per micro-batch)
  fsdp: int = 1  # fsdp across them: parameter all-gathers cross the slow links every step
  expert: int = 1  # refused unless allow_slow_axes: all-to-alls in every layer
  context: int = 1  # refused unless allow_slow_axes: exchanges in every attention layer
  tensor: int = 1  # refused unless allow_slow_axes: all-reduces in every layer
  allow_slow_axes: bool = False  # accept expert, context or tensor across slices or processes

  def __post_init__(self):
    for axis in MESH_AXES:
      if getattr(self, axis) < 1:
        raise ConfigError(f'dcn_mesh.{axis}={getattr(self, axis)} must be >= 1 (no -1 here: '
                          'mesh.* fills within a slice or process)')
    slow = [a for a in LAYER_AXES if getattr(self, a) > 1]
    if slow and not self.allow_slow_axes:
      raise ConfigError(f'dcn_mesh.{slow[0]}={getattr(self, slow[0])} puts the {slow[0]} axis '
                        'across slices or processes, whose links are the slowest, with '
                        'collectives in every layer; keep it in mesh.' + slow[0] + ', or set '
                        'dcn_mesh.allow_slow_axes=true if you mean it')

  @property
  def granules(self) -> int:
    return math.prod(getattr(self, a) for a in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """data.name='synthetic': Gaussian features labelled by a fixed linear teacher; 'synthetic_tokens':
  uniform random token rows of data.seq_len (benchmarks)."""
  examples: int = 8192  # examples in the set (was data.synthetic_examples: deprecated name)
  features: int = 784  # features per example (was data.synthetic_features: deprecated name)

  def __post_init__(self):
    _positive('data.synthetic.examples', self.examples)
    _positive('data.synthetic.features', self.features)


@dataclasses.dataclass(frozen=True)
class TextConfig:
  """data.name='text': byte windows of the standard library's *.py files (or of data.dir)."""
  bytes: int = 2**21  # bytes of text read, in sorted file order (was data.text_bytes)

  def __post_init__(self):
    _positive('data.text.bytes', self.bytes)


@dataclasses.dataclass(frozen=True)
class TokensConfig:
  """data.name='tokens': flat token files (nanoGPT's .bin: raw token ids, no header)."""
  dtype: str = 'uint16'  # uint16 (vocabularies up to 65,536) or uint32

  def __post_init__(self):
    _one_of('data.tokens.dtype', self.dtype, TOKEN_DTYPES)


@dataclasses.dataclass(frozen=True)
class SftConfig:
  """data.name='sft': JSON lines of prompt/completion pairs or chat turns (data/text.py)."""
  prompt_field: str = 'prompt'  # the prompt: read, never trained
  completion_field: str = 'completion'  # trained: the loss counts these tokens only
  messages_field: str = 'messages'  # [{"role", "content"}, ...]; assistant turns are trained
  # How chat turns become text: auto (the tokenizer directory's own template, chat_template.jinja
  # or tokenizer_config.json's, else plain), plain ('<|role|>' lines) or a .jinja file
  # (disttrain/data/chat.py).
  chat_template: str = 'auto'


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which data, where it lives, how it is split and read. Per-source fields sit in groups."""
  # A builder in disttrain.data.sources.SOURCES: digits (scikit-learn's 1,797 real 8x8 digits),
  # mnist (IDX files in data.dir), synthetic (benchmarks), text (byte windows), and from
  # data.train_files: array_record, tokens, documents (raw text), sft (prompt/completion or chat),
  # preference (prompt/chosen/rejected pairs for DPO), prompts (GRPO: a prompt and the fields
  # its rewards read).
  name: str = 'digits'
  # mnist: a folder with train-*/t10k-* IDX files (gzipped or not); text: a folder of text files
  # ('' = the standard library's *.py).
  dir: str = ''
  # array_record / tokens / documents / sft / preference / prompts: comma-separated local file
  # globs.
  train_files: str = ''
  # The eval split's file globs; '' = hold out data.eval_examples of the train files (documents:
  # whole documents).
  eval_files: str = ''
  # Examples held out for eval when the source has no separate eval split (the last N in file
  # order). -1 = the source's default: 297 (digits), 2000 (mnist with only the t10k pair), 1024
  # (synthetic), 256 (text), 0 (files).
  eval_examples: int = -1
  # Downstream evaluations of a language model, run with each eval: 'NAME=PATH;NAME=PATH' (a
  # config file may give ((name, path), ...)), each PATH local JSON lines of multiple-choice
  # {"context", "choices", "answer"} or generation {"prompt", "answer"} examples; records
  # NAME/accuracy, NAME/accuracy_norm or NAME/exact_match (disttrain/evaluation/).
  eval_tasks: Any = ''
  eval_max_new_tokens: int = 64  # generation tasks: greedy tokens per prompt at most
  # lm-evaluation-harness tasks run with each eval, comma-separated names (pip install lm_eval);
  # records <task>/<metric> as the harness names them (acc, acc_norm, exact_match, ...).
  eval_harness: str = ''
  eval_harness_limit: int = 0  # examples per harness task at most; 0 = all
  eval_harness_include: str = ''  # a directory of your own YAML tasks for data.eval_harness
  seq_len: int = 128  # language-model data: tokens per row (targets are the next tokens)
  workers: int = 0  # worker processes that read and transform train batches; 0 = a thread
  # Global batches read ahead of the step in a thread; -1 = 0 on CPU devices (XLA's step uses
  # every core: a reader thread slowed it down, measured), 2 on accelerators.
  prefetch: int = -1
  # documents / sft: raw text tokenized with a Hugging Face tokenizer.json (or a directory with
  # one) or a SentencePiece .model; '' = bytes (end of sequence 256).
  tokenizer: str = ''
  # documents / sft / tokens: concat (joined, cut into windows) or documents (whole documents in
  # rows by best fit, with segment_ids and positions; token files need the converter's .docs.npy).
  # '' = documents for sft (a fine-tuning example is never cut across rows), concat otherwise.
  packing: str = ''
  text_field: str = 'text'  # documents: the JSONL field / Parquet column holding the text
  # Several sources of data.name's kind in proportion: 'web=GLOB:0.7;code=GLOB:0.3' (the weight
  # after each source's last colon; a config file may give ((name, glob, weight), ...)); rows
  # come from a deterministic schedule of the weights (disttrain/data/mixture.py). '' = one
  # source, data.train_files. Replaces data.train_files; eval: data.eval_files, or each source's
  # last data.eval_examples as an eval set named after it.
  mixture: Any = ''
  # New weights from a step on (that step's batch included): 'STEP:NAME=WEIGHT,...;...' (or
  # ((step, {name: weight}), ...)); a source left out gets weight 0. The steps before the first
  # stage use data.mixture's weights.
  mixture_stages: Any = ''
  # A mixture source that has given every row: repeat (its next epoch, counted per source) or
  # stop (the run ends with a checkpoint at the last step before that).
  mixture_exhausted: str = 'repeat'
  synthetic: SyntheticConfig = SyntheticConfig()
  text: TextConfig = TextConfig()
  tokens: TokensConfig = TokensConfig()
  sft: SftConfig = SftConfig()

  def __post_init__(self):
    if self.packing:
      _one_of('data.packing', self.packing, PACKING)
    # data.name is checked against disttrain.data.sources.SOURCES when the data is built.
    if self.name == 'mnist' and not self.dir:
      raise ConfigError("data.name='mnist' needs data.dir; pass --config.data.dir=PATH/TO/MNIST")
    _one_of('data.mixture_exhausted', self.mixture_exhausted, ('repeat', 'stop'))
    if self.mixture and self.name not in MIXABLE:
      raise ConfigError(f'data.mixture mixes sources of data.name in {MIXABLE}, not '
                        f'{self.name!r}; pick one of them or drop data.mixture')
    if self.mixture and self.train_files:
      raise ConfigError('data.mixture and data.train_files are both set; the mixture names its '
                        'own files, so drop data.train_files')
    if self.mixture_stages and not self.mixture:
      raise ConfigError('data.mixture_stages needs data.mixture (the sources whose weights it '
                        "changes); set data.mixture='NAME=GLOB:WEIGHT;...'")
    if self.name in FILE_SOURCES and not self.train_files and not self.mixture:
      raise ConfigError(f'data.name={self.name!r} needs data.train_files; pass '
                        '--config.data.train_files=GLOB (comma-separate several)')
    if self.eval_examples != -1:
      _positive('data.eval_examples', self.eval_examples)
    _positive('data.seq_len', self.seq_len)
    _positive('data.eval_max_new_tokens', self.eval_max_new_tokens)
    _positive('data.eval_harness_limit', self.eval_harness_limit, allow_zero=True)
    _positive('data.workers', self.workers, allow_zero=True)
    if self.prefetch < -1:
      raise ConfigError(f'data.prefetch={self.prefetch} must be -1 (auto) or >= 0; pass one')

  @property
  def packed_as(self) -> str:
    """data.packing with '' resolved: what the run does (the console's data line says it)."""
    return self.packing or ('documents' if self.name == 'sft' else 'concat')


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
    _one_of('model.rope_scaling.kind', self.kind, ('', 'llama3', 'linear'))
    _positive('model.rope_scaling.factor', self.factor)
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
  # are dropped and reported as moe_dropped.
  expert_capacity: float = 1.25
  router_aux_weight: float = 0.01  # MoE: weight of the load-balancing loss (Switch)
  router_z_weight: float = 0.001  # MoE: weight of the router z-loss (ST-MoE)
  # MoE: the k chosen experts' router probabilities renormalised to sum to 1 (Mixtral, Qwen3-MoE's
  # norm_topk_prob=true); False keeps their shares of the softmax over all experts.
  moe_norm_topk: bool = True
  # Language models: the cross-entropy's chunk in tokens, so the [B, T, V] logits are never held
  # whole (disttrain/models/chunked_loss.py); 0 = auto (chunks of <= 64 MiB of logits per row
  # once a row's logits exceed 128 MiB), -1 = never. run.json's `loss` says what was picked.
  loss_chunk: int = 0

  def __post_init__(self):
    _positive('model.hidden', self.hidden)
    _positive('model.num_layers', self.num_layers)
    _positive('model.num_heads', self.num_heads)
    _positive('model.mlp_dim', self.mlp_dim, allow_zero=True)
    _positive('model.num_classes', self.num_classes)
    _positive('model.vocab_size', self.vocab_size)
    _one_of('model.remat', self.remat, REMAT)
    _positive('model.scan_unroll', self.scan_unroll)
    _one_of('model.norm', self.norm, ('', 'layernorm', 'rmsnorm'))
    _positive('model.num_kv_heads', self.num_kv_heads, allow_zero=True)
    _positive('model.rope_theta', self.rope_theta)
    _positive('model.norm_eps', self.norm_eps)
    _positive('model.max_seq_len', self.max_seq_len, allow_zero=True)
    _positive('model.head_dim', self.head_dim, allow_zero=True)
    _positive('model.sliding_window', self.sliding_window, allow_zero=True)
    for name in ('sliding_window_pattern', 'local_rope_theta', 'query_pre_attn_scalar',
                 'attn_softcap', 'final_softcap'):
      _positive(f'model.{name}', getattr(self, name), allow_zero=True)
    if self.loss_chunk < -1:
      raise ConfigError(f'model.loss_chunk={self.loss_chunk}: set tokens per chunk (> 0), 0 for '
                        'auto or -1 for the whole sequence at once')
    _one_of('model.attention', self.attention, ATTENTION)
    _positive('model.attention_block', self.attention_block)
    _positive('model.num_experts', self.num_experts, allow_zero=True)
    _positive('model.experts_per_token', self.experts_per_token)
    _positive('model.expert_capacity', self.expert_capacity, allow_zero=True)
    _positive('model.router_aux_weight', self.router_aux_weight, allow_zero=True)
    _positive('model.router_z_weight', self.router_z_weight, allow_zero=True)
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
    _one_of('precision.compute_dtype', self.compute_dtype, ('float32', 'bfloat16'))
    _one_of('precision.param_dtype', self.param_dtype, ('float32',))
    _one_of('precision.matmul', self.matmul, ('default', 'float8'))
    if self.matmul == 'float8' and self.compute_dtype != 'bfloat16':
      raise ConfigError(f"precision.matmul='float8' runs beside bfloat16 activations, got "
                        f"precision.compute_dtype={self.compute_dtype!r}; set "
                        "precision.compute_dtype='bfloat16'")


@dataclasses.dataclass(frozen=True)
class EarlyStopConfig:
  """Stop when an eval metric stopped improving (disttrain.EarlyStopping)."""
  metric: str = ''  # e.g. 'eval/accuracy' or 'val/loss'; '' = off
  mode: str = 'max'  # max or min
  patience: int = 3  # evals without an improvement of more than min_delta before stopping
  min_delta: float = 0.0  # the smallest change that counts as an improvement

  def __post_init__(self):
    _one_of('early_stop.mode', self.mode, ('max', 'min'))
    _positive('early_stop.patience', self.patience)
    _positive('early_stop.min_delta', self.min_delta, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  """A jax.profiler trace of a few steps into DIR/plugins/profile (TensorBoard's layout)."""
  start_step: int = 0  # first traced step; 0 = off
  num_steps: int = 0  # steps traced; 0 = off
  all_processes: bool = False  # trace every process, not only process 0

  def __post_init__(self):
    _positive('profile.start_step', self.start_step, allow_zero=True)
    _positive('profile.num_steps', self.num_steps, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class TrackingConfig:
  """Experiment trackers that process 0 feeds (disttrain/operating/tracking.py): MLflow (the
  mlflow extra) and Weights & Biases (the wandb extra); both off by default."""
  mlflow_uri: str = ''  # MLflow: sqlite:////ABS/mlflow.db, http://HOST:5000, ...; '' = off
  wandb_mode: str = ''  # Weights & Biases: online or offline (no account needed); '' = off
  project: str = 'disttrain'  # MLflow experiment and W&B project
  run_name: str = ''  # the tracker run's name; '' = the workdir's base name
  wandb_dir: str = ''  # where W&B keeps its run files; '' = the workdir (if local), else W&B's own

  def __post_init__(self):
    _one_of('tracking.wandb_mode', self.wandb_mode, ('', 'online', 'offline'))
    # MLflow takes a bare path as its deprecated file store: ask for an explicit scheme.
    if self.mlflow_uri and not re.match(r'^[a-zA-Z][a-zA-Z0-9+.-]*:', self.mlflow_uri):
      raise ConfigError(f'tracking.mlflow_uri={self.mlflow_uri!r} is not a URI; pass e.g. '
                        'sqlite:////ABS/PATH/mlflow.db or http://HOST:5000')
    if (self.mlflow_uri or self.wandb_mode) and not self.project:
      raise ConfigError("tracking.project='' names no MLflow experiment / W&B project; pass one")


LORA_TARGETS = r'(attention/(query|key|value|qkv|out)|mlp/(gate|up|down|mlp_in|mlp_out))/kernel$'


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (disttrain/models/lora.py): only they train, the base weights are frozen
  and stored once; language models."""
  rank: int = 0  # adapter rank r; 0 = off (every weight trains)
  alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  dropout: float = 0.0  # dropout on the adapters' input while training (PEFT's lora_dropout)
  # regex searched in each projection's parameter path ('blocks/attention/query/kernel'); the
  # default: every attention and MLP projection
  targets: str = LORA_TARGETS
  base_dtype: str = 'float32'  # the frozen base weights' storage: float32 or bfloat16

  def __post_init__(self):
    _positive('lora.rank', self.rank, allow_zero=True)
    if self.alpha <= 0:
      raise ConfigError(f'lora.alpha={self.alpha} must be > 0; PEFT uses e.g. 16 or 2 x rank')
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f'lora.dropout={self.dropout} must be in [0, 1)')
    _one_of('lora.base_dtype', self.base_dtype, ('float32', 'bfloat16'))
    try:
      re.compile(self.targets)
    except re.error as e:
      raise ConfigError(f'lora.targets={self.targets!r} is not a regex ({e}); pass e.g. '
                        "'attention/(query|value)/kernel$'") from None


@dataclasses.dataclass(frozen=True)
class DpoConfig:
  """Direct preference optimization (data.name='preference'; disttrain/models/preference.py)."""
  beta: float = 0.1  # the rewards' scale: beta x (policy - reference) summed log-probabilities

  def __post_init__(self):
    if self.beta <= 0:
      raise ConfigError(f'dpo.beta={self.beta} must be > 0; TRL uses 0.1')


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """Reinforcement learning with verifiable rewards (data.name='prompts'; training/rollout.py,
  models/grpo.py). global_batch_size counts completions: global_batch_size / group_size prompts a
  step, each sampled group_size times; data.seq_len is the prompts' length (left-padded)."""
  # Reward functions f(prompts, completions, **fields) -> list[float] (TRL's reward_funcs),
  # comma-separated module.function dotted paths; summed. '' = the config file's get_rewards().
  rewards: str = ''
  group_size: int = 8  # completions sampled per prompt; advantages are normalized in the group
  max_new_tokens: int = 64  # a completion's length at most (it ends earlier at the EOS token)
  temperature: float = 1.0  # sampling temperature; the log-probabilities trained use it too
  top_k: int = 0  # sample among the k most likely tokens; 0 = all
  top_p: float = 1.0  # nucleus sampling: the smallest set of tokens reaching this mass
  epsilon: float = 0.2  # the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high]
  epsilon_high: float = -1.0  # -1 = epsilon (DAPO raises it, e.g. 0.28)
  beta: float = 0.0  # the KL penalty to the starting model (k3 estimator); 0 = no reference pass
  # Updates per sampled batch (GRPO's mu); > 1 needs steps_per_dispatch equal to it (the updates
  # of one batch run as one dispatch, so checkpoints fall between batches).
  iterations: int = 1

  def __post_init__(self):
    if self.group_size < 2:
      raise ConfigError(f'grpo.group_size={self.group_size}: an advantage is a reward against its '
                        "group's mean, 0 in a group of one; sample >= 2 completions per prompt "
                        '(e.g. 8)')
    _positive('grpo.max_new_tokens', self.max_new_tokens)
    _positive('grpo.temperature', self.temperature)
    _positive('grpo.top_k', self.top_k, allow_zero=True)
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigError(f'grpo.top_p={self.top_p} must be in (0, 1]')
    _positive('grpo.epsilon', self.epsilon)
    if self.epsilon_high != -1.0 and self.epsilon_high <= 0:
      raise ConfigError(f'grpo.epsilon_high={self.epsilon_high} must be > 0, or -1 (= epsilon)')
    _positive('grpo.beta', self.beta, allow_zero=True)
    _positive('grpo.iterations', self.iterations)

  @property
  def clip_high(self) -> float:
    return self.epsilon if self.epsilon_high == -1.0 else self.epsilon_high


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole run. Each field's comment is its documentation (the docs' config reference is
  generated from them)."""
  seed: int = 0  # parameter init, dropout keys (fold_in(seed, step)), shuffling, random transforms
  # Examples per step over all devices; divisible by the batch's mesh ways (data x fsdp x expert),
  # times grad_accum_steps.
  global_batch_size: int = 128
  eval_batch_size: int = 0  # 0 = global_batch_size
  num_train_steps: int = 1000  # optimizer steps
  learning_rate: float = 1e-3  # peak learning rate (0 freezes the parameters)
  # adam, adamw, sgd, adafactor, lion or muon (optax.contrib.muon: Newton-Schulz orthogonalised
  # momentum for the blocks' weight matrices, each layer's separately, at learning_rate, ~0.02;
  # AdamW for embeddings, output head, norms and biases at adam_learning_rate).
  optimizer: str = 'adam'
  adam_learning_rate: float = 0.0  # muon: peak of its AdamW part, same schedule; 0 = learning_rate
  # constant, cosine, linear (decay to min_lr_ratio x the peak after the warm-up), or wsd
  # (warm-up, stable, linear decay over the last wsd_decay_fraction).
  lr_schedule: str = 'constant'
  warmup_steps: int = 0  # linear warm-up from 0
  weight_decay: float = 0.0  # adamw, lion, adafactor: weight matrices only; muon: its matrices
  weight_decay_embeddings: bool = False  # also decay embedding tables (token, positions)
  momentum: float = 0.0  # sgd only
  # adam/adamw/lion (muon: its AdamW part) first-moment decay (adafactor: momentum); -1 = default
  b1: float = -1.0
  b2: float = -1.0  # adam/adamw/lion/muon's AdamW second-moment decay; -1 = the optimizer's default
  mu_dtype: str = ''  # first moment's dtype: '' = float32, or bfloat16 (half its memory)
  grad_clip_norm: float = 0.0  # clip gradients to this global norm before the update; 0 = off
  min_lr_ratio: float = 0.0  # cosine, linear, wsd: the schedule ends at this x learning_rate
  wsd_decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
  ema_decay: float = 0.0  # keep an exponential moving average of the parameters; 0 = off
  ema_eval: bool = True  # with ema_decay: evals use the moving average
  mesh: MeshConfig = MeshConfig()
  dcn_mesh: DcnMeshConfig = DcnMeshConfig()  # axes across slices or processes (hybrid mesh)
  # replicate (data parallel) or fsdp (split each large parameter's largest divisible dimension,
  # and its optimizer state, over mesh.fsdp).
  sharding: str = 'replicate'
  fsdp_min_size: int = 2**14  # fsdp leaves parameters with fewer elements replicated
  # Tensor parallelism: ((regex on 'a/b/kernel' paths, spec), ...), spec a tuple of mesh axes or
  # None per dimension; first match wins and beats logical rules.
  param_rules: tuple = ()
  # ((logical axis name, mesh axis or None), ...) for Flax logical-axis metadata.
  logical_rules: tuple = ()
  step_mode: str = 'jit'  # jit, shard_map or pmap: how the step is compiled over the mesh
  # K steps per compiled call (lax.scan over K batches), like Keras' steps_per_execution;
  # num_train_steps and every *_every_steps must be multiples of K.
  steps_per_dispatch: int = 1
  data: DataConfig = DataConfig()
  model: ModelConfig = ModelConfig()
  log_every_steps: int = 50  # a train record every N steps (its loss: the mean since the last)
  eval_every_steps: int = 0  # eval over every eval source every N steps; 0 = only at the end
  checkpoint_every_steps: int = 0  # async save into DIR/checkpoints every N steps; 0 = at the end
  max_to_keep: int = 3  # newest checkpoints kept (plus the best one if best_metric is set)
  # The fast tier (storage/local_tier.py): each process's shards, and a copy of its peer's, on
  # its own disk every N steps; a restart takes the newest step of either tier. 0 = off.
  local_checkpoint_every_steps: int = 0
  # Where the fast tier writes (a local disk, or /dev/shm for memory); '' = a directory under
  # the system's temporary directory named for the workdir.
  local_checkpoint_dir: str = ''
  # Language models: a Hugging Face directory (config.json, safetensors, tokenizer, chat
  # template) in DIR/hf/<step> every N steps and at the last step; 0 = none (disttrain export
  # writes one from any checkpoint). disttrain/hf/saves.py.
  hf_save_every_steps: int = 0
  hf_save_dtype: str = 'float32'  # float32 or bfloat16: the weights' dtype in those saves
  # An eval metric whose best checkpoint is also kept ('accuracy', or 'val/accuracy' for a named
  # eval source); checkpoint_every_steps must be a positive multiple of eval_every_steps.
  best_metric: str = ''
  best_mode: str = 'max'  # 'max' or 'min' for best_metric
  # Warm start: params and mutable collections from another run's checkpoint (a checkpoints dir
  # or one step in it) or a Hugging Face model directory (llama, qwen2, qwen3, mistral, gpt);
  # optimizer, step and data order start fresh; ignored when the workdir has a checkpoint of its
  # own.
  restore_from: str = ''
  precision: PrecisionConfig = PrecisionConfig()
  lora: LoraConfig = LoraConfig()  # low-rank adapters (language models); lora.rank > 0 turns on
  dpo: DpoConfig = DpoConfig()  # preference optimization, with data.name='preference'
  grpo: GrpoConfig = GrpoConfig()  # reinforcement learning, with data.name='prompts'
  grad_accum_steps: int = 1  # micro-batches per step (lax.scan in the step), one update per step
  # Per-device bytes a train step may need (XLA's memory analysis, checked before the first
  # step); 0 = the device's own limit where it reports one (accelerators), else unchecked.
  memory_limit_bytes: int = 0
  peak_flops_per_device: float = 0.0  # for MFU; 0 = from the accelerator table (none on CPU)
  early_stop: EarlyStopConfig = EarlyStopConfig()
  profile: ProfileConfig = ProfileConfig()
  tracking: TrackingConfig = TrackingConfig()
  # Seconds without a finished step before every process dumps its stacks and the job stops
  # (exit 3); -1 = 600 for multi-process runs and off for one process, 0 = off.
  watchdog_seconds: int = -1
  # Process 0 holds DIR/lease.json, refreshed every lease_seconds / 4: a second launch into the
  # workdir of a live run refuses (exit 2); a dead run's lease is taken over (at once on its own
  # host, else lease_seconds after its last refresh). 0 = no lease.
  lease_seconds: float = 60.0

  def __post_init__(self):
    _positive('seed', self.seed, allow_zero=True)
    _positive('global_batch_size', self.global_batch_size)
    _positive('eval_batch_size', self.eval_batch_size, allow_zero=True)
    _positive('num_train_steps', self.num_train_steps)
    _positive('learning_rate', self.learning_rate, allow_zero=True)  # 0: frozen (evals, tests)
    _one_of('optimizer', self.optimizer, OPTIMIZERS)
    _one_of('lr_schedule', self.lr_schedule, LR_SCHEDULES)
    _positive('warmup_steps', self.warmup_steps, allow_zero=True)
    _positive('weight_decay', self.weight_decay, allow_zero=True)
    _positive('grad_clip_norm', self.grad_clip_norm, allow_zero=True)
    _one_of('mu_dtype', self.mu_dtype, ('', 'float32', 'bfloat16'))
    _positive('adam_learning_rate', self.adam_learning_rate, allow_zero=True)
    if self.adam_learning_rate and self.optimizer != 'muon':
      raise ConfigError(f'adam_learning_rate={self.adam_learning_rate} is the AdamW part of '
                        f"optimizer='muon', got optimizer={self.optimizer!r}; set "
                        "optimizer='muon' or leave adam_learning_rate at 0")
    if self.optimizer == 'muon' and self.weight_decay_embeddings:
      raise ConfigError("weight_decay_embeddings=True: optimizer='muon' updates the embeddings "
                        'with its AdamW part, which is not decayed; use optimizer=adamw or '
                        'leave weight_decay_embeddings off')
    for name in ('b1', 'b2'):
      value = getattr(self, name)
      if value != -1.0 and not 0.0 <= value < 1.0:
        raise ConfigError(f'{name}={value} must be in [0, 1), or -1 for the optimizer default')
    for name in ('min_lr_ratio', 'ema_decay'):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ConfigError(f'{name}={getattr(self, name)} must be in [0, 1); pass a fraction')
    if not 0.0 < self.wsd_decay_fraction <= 1.0:
      raise ConfigError(f'wsd_decay_fraction={self.wsd_decay_fraction} must be in (0, 1]')
    _one_of('sharding', self.sharding, SHARDINGS)
    _positive('fsdp_min_size', self.fsdp_min_size, allow_zero=True)
    _one_of('step_mode', self.step_mode, STEP_MODES)
    _positive('log_every_steps', self.log_every_steps)
    _positive('eval_every_steps', self.eval_every_steps, allow_zero=True)
    _positive('checkpoint_every_steps', self.checkpoint_every_steps, allow_zero=True)
    _positive('hf_save_every_steps', self.hf_save_every_steps, allow_zero=True)
    _positive('local_checkpoint_every_steps', self.local_checkpoint_every_steps, allow_zero=True)
    if self.local_checkpoint_every_steps and self.step_mode == 'pmap':
      raise ConfigError('local_checkpoint_every_steps needs a mesh-sharded state, not '
                        'step_mode=pmap; use step_mode=jit or shard_map, or leave it at 0')
    if '://' in self.local_checkpoint_dir:
      raise ConfigError(f'local_checkpoint_dir={self.local_checkpoint_dir!r} is a URL; the '
                        "fast tier is each host's own disk or memory: pass a local path "
                        '(e.g. /dev/shm/disttrain) or leave it empty')
    _one_of('hf_save_dtype', self.hf_save_dtype, ('float32', 'bfloat16'))
    _positive('max_to_keep', self.max_to_keep)
    _one_of('best_mode', self.best_mode, ('max', 'min'))
    if self.best_metric and not (self.eval_every_steps and self.checkpoint_every_steps and
                                 self.checkpoint_every_steps % self.eval_every_steps == 0):
      raise ConfigError(
          f'best_metric={self.best_metric!r} ranks checkpoints by the eval at their step, so '
          f'checkpoint_every_steps={self.checkpoint_every_steps} must be a positive multiple of '
          f'eval_every_steps={self.eval_every_steps}; set both, e.g. eval_every_steps=100 '
          'checkpoint_every_steps=100')
    _check_rules(self.param_rules, self.logical_rules)
    self._check_dispatch()
    self._check_grpo()
    _positive('grad_accum_steps', self.grad_accum_steps)
    _positive('memory_limit_bytes', self.memory_limit_bytes, allow_zero=True)
    _positive('peak_flops_per_device', self.peak_flops_per_device, allow_zero=True)
    if self.watchdog_seconds < -1:
      raise ConfigError(f'watchdog_seconds={self.watchdog_seconds} must be -1 (auto), 0 (off) or '
                        'a number of seconds; pass one of them')
    _positive('lease_seconds', self.lease_seconds, allow_zero=True)
    if bool(self.profile.start_step) != bool(self.profile.num_steps):
      raise ConfigError(f'profile.start_step={self.profile.start_step} profile.num_steps='
                        f'{self.profile.num_steps}: set both (> 0) to trace, or both 0 for no '
                        'trace')
    if self.step_mode == 'pmap' and (self.mesh.fsdp != 1 or self.mesh.tensor != 1
                                     or self.sharding != 'replicate'):
      raise ConfigError(
          f'step_mode=pmap is data parallel only, got mesh.fsdp={self.mesh.fsdp} '
          f'mesh.tensor={self.mesh.tensor} sharding={self.sharding}; use step_mode=jit or '
          'shard_map for fsdp/tensor layouts')
    if self.mesh.context != 1 and self.step_mode != 'jit':
      raise ConfigError(
          f'mesh.context={self.mesh.context} splits sequences inside the jit step, not '
          f'step_mode={self.step_mode}; use step_mode=jit')
    if self.mesh.stage != 1 and self.step_mode != 'jit':
      raise ConfigError(
          f'mesh.stage={self.mesh.stage} pipelines layers inside the jit step, not '
          f'step_mode={self.step_mode}; use step_mode=jit')
    if self.mesh.stage > 1 and self.grad_accum_steps < self.mesh.stage:
      raise ConfigError(
          f'mesh.stage={self.mesh.stage} needs at least as many micro-batches as stages, got '
          f'grad_accum_steps={self.grad_accum_steps}; set grad_accum_steps >= '
          f'{self.mesh.stage} (more cut the pipeline bubble, (S - 1) / (M + S - 1))')
    if self.mesh.expert != 1 and self.step_mode != 'jit':
      raise ConfigError(
          f'mesh.expert={self.mesh.expert} splits experts inside the jit step, not '
          f'step_mode={self.step_mode}; use step_mode=jit')
    if self.step_mode == 'shard_map' and self.mesh.tensor != 1:
      raise ConfigError(
          f'step_mode=shard_map splits the batch only, got mesh.tensor={self.mesh.tensor}; use '
          'step_mode=jit for tensor parallelism')
    if self.precision.matmul == 'float8' and self.step_mode != 'jit':
      raise ConfigError(
          f"precision.matmul='float8' scales each tensor by its amax over the whole batch, which "
          f'step_mode={self.step_mode} would take per device; use step_mode=jit')

  def _check_grpo(self) -> None:
    if self.data.name != 'prompts':
      return
    g = self.grpo
    if self.global_batch_size % g.group_size:
      raise ConfigError(f'global_batch_size={self.global_batch_size} counts completions, '
                        f'grpo.group_size={g.group_size} per prompt: use a multiple of '
                        f'{g.group_size}')
    if self.steps_per_dispatch != g.iterations:
      raise ConfigError(f'grpo.iterations={g.iterations} updates per sampled batch run as one '
                        f'dispatch: set steps_per_dispatch={g.iterations} (got '
                        f'{self.steps_per_dispatch})')
    if self.step_mode == 'pmap' or self.mesh.stage != 1 or self.mesh.context != 1:
      raise ConfigError('data.name=prompts samples with the KV-cache decoder on data, fsdp, '
                        'tensor and expert layouts; set mesh.stage=1, mesh.context=1 and '
                        'step_mode=jit or shard_map')

  def _check_dispatch(self) -> None:
    k = self.steps_per_dispatch
    _positive('steps_per_dispatch', k)
    if k == 1:
      return
    if self.step_mode == 'pmap':
      raise ConfigError(f'steps_per_dispatch={k} needs step_mode=jit or shard_map, not pmap; '
                        'use one of them or steps_per_dispatch=1')
    for name in ('num_train_steps', 'log_every_steps', 'eval_every_steps',
                 'checkpoint_every_steps', 'hf_save_every_steps',
                 'local_checkpoint_every_steps'):
      if getattr(self, name) % k:
        raise ConfigError(f'{name}={getattr(self, name)} is not a multiple of '
                          f'steps_per_dispatch={k}; use a multiple of {k}')

  @property
  def row_tokens(self) -> int:
    """Tokens in a training row: data.seq_len, plus GRPO's completion after its prompt (the
    default length of a GPT's positions table)."""
    return self.data.seq_len + (self.grpo.max_new_tokens if self.data.name == 'prompts' else 0)

  @property
  def eval_batch(self) -> int:
    return self.eval_batch_size or self.global_batch_size

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _check_rules(param_rules, logical_rules) -> None:
  for rule in param_rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
            and isinstance(rule[1], (tuple, list))):
      raise ConfigError(f'param_rules entry {rule!r} must be (regex, (axis or None, ...)); pass '
                        'e.g. --config.param_rules="((\'Dense_0/kernel\', (None, \'tensor\')),)"')
    _check_axes(f'param_rules {rule[0]!r}', rule[1])
  for rule in logical_rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(f'logical_rules entry {rule!r} must be (logical name, mesh axis or None); '
                        'pass e.g. --config.logical_rules="((\'hidden\', \'tensor\'),)"')
    _check_axes(f'logical_rules {rule[0]!r}', (rule[1],))


def _check_axes(where: str, spec) -> None:
  for entry in spec:
    for axis in (entry if isinstance(entry, (tuple, list)) else (entry,)):
      if axis is not None and axis not in MESH_AXES:
        raise ConfigError(
            f'{where} names mesh axis {axis!r}, which is not one of {MESH_AXES}; use one of them '
            'or None')


# Renamed fields, old path -> new path. The old names stay settable in config files and overrides
# (-1 = not set) and print one deprecation line; they are not part of the resolved Config.
DEPRECATED = {'data.synthetic_examples': 'data.synthetic.examples',
              'data.synthetic_features': 'data.synthetic.features',
              'data.text_bytes': 'data.text.bytes'}


def defaults(config: Config | None = None) -> ml_collections.ConfigDict:
  """A locked ConfigDict of every field, for config files and command-line overrides."""
  def to_plain(value):
    if dataclasses.is_dataclass(value):
      return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value
  tree = to_plain(config or Config())
  for old in DEPRECATED:
    group, name = old.split('.')
    tree[group][name] = -1
  cd = ml_collections.ConfigDict(tree)
  # data.mixture and data.mixture_stages take a string or a tuple (type-checked when built).
  cd.data = ml_collections.ConfigDict(tree['data'], type_safe=False)
  cd.lock()  # unknown fields in config files and --config.<field> overrides are errors
  return cd


def from_config_dict(cd: ml_collections.ConfigDict | dict) -> Config:
  """Builds and validates a Config; unknown fields or wrong types raise ConfigError."""
  tree = cd.to_dict() if isinstance(cd, ml_collections.ConfigDict) else copy.deepcopy(dict(cd))
  _apply_deprecated(tree)
  return _build(Config, tree, '')


def _apply_deprecated(tree: dict) -> None:
  """Moves values given under deprecated names to their new fields (one warning line each)."""
  for old, new in DEPRECATED.items():
    group, name = old.split('.')
    value = tree.get(group, {}).pop(name, -1)
    if value == -1:
      continue
    print(f'warning: config field {old} is deprecated; use {new} (set to {value!r})',
          file=sys.stderr, flush=True)
    node = tree
    *parents, leaf = new.split('.')
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value


def _build(cls, tree: dict, prefix: str):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(tree) - set(fields))
  if unknown:
    raise ConfigError(f'unknown config field {prefix}{unknown[0]}; known fields: '
                      f'{", ".join(prefix + n for n in fields)}')
  kwargs = {}
  for name, value in tree.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
      if not isinstance(value, dict):
        raise ConfigError(f'{prefix}{name} must be a group of fields, got {value!r}')
      kwargs[name] = _build(hint, value, f'{prefix}{name}.')
    else:
      kwargs[name] = _coerce(f'{prefix}{name}', value, hint)
  return cls(**kwargs)


def _coerce(name: str, value: Any, hint: Any) -> Any:
  """Checks a leaf's type; ints are accepted for floats, lists become tuples."""
  if hint is Any:  # checked by the field's own parser (data.mixture: a string or a tuple)
    return value
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint is tuple:
    if isinstance(value, (list, tuple)):
      return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    raise ConfigError(f'{name}={value!r} must be a tuple')
  if isinstance(hint, type) and not isinstance(value, hint) or (
      hint is int and isinstance(value, bool)):
    raise ConfigError(f'{name}={value!r} must be of type {hint.__name__}')
  return value



"""Config, a whole run: its top-level fields (optimizer, schedule, cadence of logs, evals and
checkpoints, guards) and groups (operating.py: early_stop, profile, tracking), and the checks
across groups."""

import dataclasses

from disttrain.config import conditional
from disttrain.config.checks import one_of, positive
from disttrain.config.data import DataConfig
from disttrain.config.layout import (SHARDINGS, STEP_MODES, DcnMeshConfig, MeshConfig,
                                     axis_label, axis_size, check_rules, check_step_mode)
from disttrain.config.model import ModelConfig, PrecisionConfig
from disttrain.config.operating import EarlyStopConfig, ProfileConfig, TrackingConfig
from disttrain.config.post_training import DpoConfig, GrpoConfig, LoraConfig
from disttrain.errors import ConfigError

OPTIMIZERS = ('adam', 'adamw', 'sgd', 'adafactor', 'lion', 'muon')
LR_SCHEDULES = ('constant', 'cosine', 'linear', 'wsd')


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
  # ((logical axis name, mesh axis, tuple of axes or None), ...) for Flax logical-axis metadata;
  # each name once.
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
  # eval source); checkpoint_every_steps must be a positive multiple of eval_every_steps. A save
  # at a stop between evals (SIGTERM) is kept as the latest, never ranked.
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
    positive('seed', self.seed, allow_zero=True)
    if self.seed >= 2**63:  # jax.random.key takes a signed 64-bit integer
      raise ConfigError(f'seed={self.seed} does not fit in 64 bits; pass a seed below 2**63')
    positive('global_batch_size', self.global_batch_size)
    positive('eval_batch_size', self.eval_batch_size, allow_zero=True)
    positive('num_train_steps', self.num_train_steps)
    positive('learning_rate', self.learning_rate, allow_zero=True)  # 0: frozen (evals, tests)
    one_of('optimizer', self.optimizer, OPTIMIZERS)
    one_of('lr_schedule', self.lr_schedule, LR_SCHEDULES)
    positive('warmup_steps', self.warmup_steps, allow_zero=True)
    positive('weight_decay', self.weight_decay, allow_zero=True)
    positive('grad_clip_norm', self.grad_clip_norm, allow_zero=True)
    one_of('mu_dtype', self.mu_dtype, ('', 'float32', 'bfloat16'))
    positive('adam_learning_rate', self.adam_learning_rate, allow_zero=True)
    if self.adam_learning_rate and self.optimizer != 'muon':
      raise ConfigError(f'adam_learning_rate={self.adam_learning_rate} is the AdamW part of '
                        f"optimizer='muon', got optimizer={self.optimizer!r}; set "
                        "optimizer='muon' or leave adam_learning_rate at 0")
    if not 0.0 <= self.momentum < 1.0 or (self.momentum and self.optimizer != 'sgd'):
      raise ConfigError(f'momentum={self.momentum} must be in [0, 1) and is read by '
                        f"optimizer='sgd' only (got {self.optimizer!r}); set b1 for adam-like "
                        'optimizers, or momentum=0')
    if self.weight_decay and self.optimizer in ('adam', 'sgd'):
      raise ConfigError(f'weight_decay={self.weight_decay} does nothing with optimizer='
                        f"{self.optimizer!r}; use optimizer='adamw' (or lion, adafactor, muon) "
                        'or set weight_decay=0')
    if self.optimizer == 'muon' and self.weight_decay_embeddings:
      raise ConfigError("weight_decay_embeddings=True: optimizer='muon' updates the embeddings "
                        'with its AdamW part, which is not decayed; use optimizer=adamw or '
                        'leave weight_decay_embeddings off')
    for name in ('b1', 'b2'):
      value = getattr(self, name)
      if value != -1.0 and not 0.0 <= value < 1.0:
        raise ConfigError(f'{name}={value} must be in [0, 1), or -1 for the optimizer default')
    # Read by no part of the chosen optimizer: refused rather than silently dropped.
    unread = [f'b1={self.b1}'] if self.b1 != -1.0 and self.optimizer == 'sgd' else []
    if self.b2 != -1.0 and self.optimizer in ('sgd', 'adafactor'):
      unread.append(f'b2={self.b2}')
    if self.mu_dtype and ((self.optimizer == 'sgd' and not self.momentum)
                          or (self.optimizer == 'adafactor' and self.b1 == -1.0)):
      unread.append(f'mu_dtype={self.mu_dtype!r}')
    if unread:
      raise ConfigError(f"{unread[0]} does nothing with optimizer={self.optimizer!r} (no such "
                        'moment: sgd takes momentum, adafactor b1 as its momentum); drop it or '
                        'pick an optimizer that reads it')
    for name in ('min_lr_ratio', 'ema_decay'):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ConfigError(f'{name}={getattr(self, name)} must be in [0, 1); pass a fraction')
    if not 0.0 < self.wsd_decay_fraction <= 1.0:
      raise ConfigError(f'wsd_decay_fraction={self.wsd_decay_fraction} must be in (0, 1]')
    one_of('sharding', self.sharding, SHARDINGS)
    positive('fsdp_min_size', self.fsdp_min_size, allow_zero=True)
    one_of('step_mode', self.step_mode, STEP_MODES)
    positive('log_every_steps', self.log_every_steps)
    positive('eval_every_steps', self.eval_every_steps, allow_zero=True)
    positive('checkpoint_every_steps', self.checkpoint_every_steps, allow_zero=True)
    positive('hf_save_every_steps', self.hf_save_every_steps, allow_zero=True)
    positive('local_checkpoint_every_steps', self.local_checkpoint_every_steps, allow_zero=True)
    if self.local_checkpoint_every_steps and self.step_mode == 'pmap':
      raise ConfigError('local_checkpoint_every_steps needs a mesh-sharded state, not '
                        'step_mode=pmap; use step_mode=jit or shard_map, or leave it at 0')
    if '://' in self.local_checkpoint_dir:
      raise ConfigError(f'local_checkpoint_dir={self.local_checkpoint_dir!r} is a URL; the '
                        "fast tier is each host's own disk or memory: pass a local path "
                        '(e.g. /dev/shm/disttrain) or leave it empty')
    one_of('hf_save_dtype', self.hf_save_dtype, ('float32', 'bfloat16'))
    positive('max_to_keep', self.max_to_keep)
    one_of('best_mode', self.best_mode, ('max', 'min'))
    if self.best_metric and not (self.eval_every_steps and self.checkpoint_every_steps and
                                 self.checkpoint_every_steps % self.eval_every_steps == 0):
      raise ConfigError(
          f'best_metric={self.best_metric!r} ranks checkpoints by the eval at their step, so '
          f'checkpoint_every_steps={self.checkpoint_every_steps} must be a positive multiple of '
          f'eval_every_steps={self.eval_every_steps}; set both, e.g. eval_every_steps=100 '
          'checkpoint_every_steps=100')
    if self.early_stop.metric and not self.eval_every_steps:
      raise ConfigError(f'early_stop.metric={self.early_stop.metric!r} acts on evals during the '
                        'run, and eval_every_steps=0 evaluates at the end only; set '
                        'eval_every_steps > 0')
    check_rules(self.param_rules, self.logical_rules)
    self._check_dispatch()
    self._check_post_training()
    positive('grad_accum_steps', self.grad_accum_steps)
    positive('memory_limit_bytes', self.memory_limit_bytes, allow_zero=True)
    positive('peak_flops_per_device', self.peak_flops_per_device, allow_zero=True)
    if self.watchdog_seconds < -1:
      raise ConfigError(f'watchdog_seconds={self.watchdog_seconds} must be -1 (auto), 0 (off) or '
                        'a number of seconds; pass one of them')
    positive('lease_seconds', self.lease_seconds, allow_zero=True)
    if bool(self.profile.start_step) != bool(self.profile.num_steps):
      raise ConfigError(f'profile.start_step={self.profile.start_step} profile.num_steps='
                        f'{self.profile.num_steps}: set both (> 0) to trace, or both 0 for no '
                        'trace')
    check_step_mode(self.mesh, self.step_mode, self.sharding, self.dcn_mesh)
    stages = axis_size(self.mesh, self.dcn_mesh, 'stage')
    if stages > 1 and self.grad_accum_steps < stages:
      raise ConfigError(
          f'{axis_label(self.mesh, self.dcn_mesh, "stage")} needs at least as many micro-batches '
          f'as stages, got grad_accum_steps={self.grad_accum_steps}; set grad_accum_steps >= '
          f'{stages} (more cut the pipeline bubble, (S - 1) / (M + S - 1))')
    if self.precision.matmul == 'float8' and self.step_mode != 'jit':
      raise ConfigError(
          f"precision.matmul='float8' scales each tensor by its amax over the whole batch, which "
          f'step_mode={self.step_mode} would take per device; use step_mode=jit')

  def _check_post_training(self) -> None:
    rates = {'model.dropout': self.model.dropout, 'lora.dropout': self.lora.dropout}
    field, rate = max(rates.items(), key=lambda kv: kv[1])
    if self.data.name in ('preference', 'prompts') and rate:
      against = 'the reference' if self.data.name == 'preference' else 'the sampler'
      raise ConfigError(f'{field}={rate} with data.name={self.data.name}: the policy '
                        f"log-probabilities are compared with {against}'s, which run without "
                        f'dropout; set --config.{field}=0 (TRL disables dropout too)')
    for _, line in conditional.unused(self)[:1]:
      raise ConfigError(line)
    if self.model.name == 'gpt' and 0 < self.model.max_seq_len < self.row_tokens:
      raise ConfigError(f'model.max_seq_len={self.model.max_seq_len} (rows of the learned '
                        f'positions table) is shorter than the rows of {self.row_tokens} tokens; '
                        f'raise it to >= {self.row_tokens}, or 0 for the row length')
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
    positive('steps_per_dispatch', k)
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

"""Everything a run is built from, before any step: mesh, data, model, state, compiled steps.

`setup` is what `train` starts with, and what tests and benchmarks drive directly; `plan` builds
the same steps over abstract state (nothing created), for the memory pre-flight (memory.py) of a
model too large for this host. run_info is run.json's description of what was built.
"""

import dataclasses
import platform
from collections.abc import Sequence
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

import disttrain
from disttrain import models, moved
from disttrain.config import Config
from disttrain.data import mixture, records as records_lib, sources
from disttrain.data.batches import element_spec
from disttrain.data.workers import check_workers
from disttrain.data.records import Records
from disttrain.errors import ConfigError, DataError, first_line
from disttrain.evaluation import downstream as downstream_lib
from disttrain.hf import config as hf_config
from disttrain.models import grpo, lora, pipeline, preference
from disttrain.operating import metrics
from disttrain.parallel import mesh as mesh_lib, optim, sharding as sharding_lib, spmd
from disttrain.parallel import state as state_lib, xla_flags
from disttrain.parallel.compiled import CompileInfo, Steps, shard_bytes
from disttrain.parallel.step import Variant
from disttrain.training import rollout

# Names that moved to another module resolve there, with a DeprecationWarning.
__getattr__ = moved.names(__name__, {})


@dataclasses.dataclass
class Setup:
  """Everything a run is built from, before any step: also what tests and benchmarks drive."""
  cfg: Config
  mesh: Mesh
  train_data: Records
  eval_data: dict[str, Records]  # split name ('eval', or the names given) -> records
  model: Any
  task: Any
  tx: Any
  lr_schedule: Any  # logged as learning_rate
  batch_sharding: Any
  state: state_lib.TrainState  # fresh, created sharded
  layout: state_lib.Layout
  steps: Steps
  step_spec: dict = None  # one train-step row ({field: ShapeDtypeStruct((1, ...))})
  rollout: Any = None  # GRPO (data.name='prompts'): prompts + state -> the step's batch
  downstream: Any = None  # data.eval_tasks, read and tokenized (evaluation.Downstream)

  @property
  def parallel(self) -> mesh_lib.Parallelism:
    return mesh_lib.Parallelism(self.mesh)


def setup(cfg: Config, model: Any = None, task: Any = None,
          devices: Sequence[jax.Device] | None = None, tx: Any = None,
          train_step: Callable | None = None, eval_step: Callable | None = None,
          train_data: Any = None, eval_data: Any = None, rewards: Any = None,
          eval_extract: Any = None) -> Setup:
  """Mesh, data, model, optimizer, sharded state and the compiled-on-first-use steps for `cfg`.

  Data: `train_data` (any source of feature dicts, or disttrain.Data with transforms) and
  `eval_data` (one source, or {name: source} for several); both default to cfg.data.name's
  built-in set when train_data is None. A dict of arrays is one in-memory source. `rewards`:
  GRPO's reward functions when grpo.rewards names none (a config file's get_rewards()).
  `eval_extract`: the answer extraction of data.eval_tasks' generation tasks (text -> str; a
  config file's get_eval_extract()), default GSM8K's.
  """
  cfg = hf_config.from_directory(cfg)  # model.name='hf': the model restore_from's config.json
  parallel = mesh_lib.Parallelism.from_config(cfg.mesh, devices, cfg.dcn_mesh)
  parallel.check_batch_sizes(cfg)
  mesh = parallel.mesh
  check_workers(cfg.data.workers)
  if train_data is None:
    built = sources.build(cfg)
    train_data, eval_data = built['train_data'], built['eval_data'] if eval_data is None else \
        eval_data
  train = mixture.train_records(train_data, cfg.global_batch_size, cfg.seed)
  evals = {name: Records(source, name, cfg.seed)
           for name, source in records_lib.named_sources(eval_data).items()}
  batch_sharding = parallel.rows
  for records in evals.values():
    if records.spec.keys() != train.spec.keys():
      raise ConfigError(f'the {records.name} data has fields {sorted(records.spec)} but the train '
                        f'data has {sorted(train.spec)}; give both the same fields')
  model, task = _objective(cfg, model, task)
  tasks = downstream_lib.Downstream.build(cfg, model, batch_sharding, evals, eval_extract)
  _check_metric_names(cfg, evals, tasks.record_names if tasks else set())
  config_tx, lr_schedule = optim.build(cfg)  # the schedule is what records log as learning_rate
  tx = tx or config_tx
  spec, sampler = element_spec(train), None
  if cfg.data.name == 'prompts':  # the step trains on what the rollout makes of the prompts
    sampler = rollout.Rollout(cfg, model, mesh, batch_sharding,
                              rollout.load_rewards(cfg.grpo.rewards, rewards))
    spec = sampler.step_spec
  parallel.check_model(model, _tokens(model, spec))
  state, lay = state_lib.create(model, tx, spec, cfg, mesh)
  steps = spmd.build(model, task, tx, cfg, mesh, lay, batch_sharding, train_step, eval_step)
  for records in evals.values():
    if records.spec != train.spec:  # else its first eval fails, after training up to it
      _check_eval_runs(steps, state, records, train, cfg.eval_batch, batch_sharding)
  return Setup(cfg, mesh, train, evals, model, task, tx, lr_schedule, batch_sharding, state, lay,
               steps, spec, sampler, tasks)


def _check_eval_runs(steps: Steps, state, records: Records, train: Records, batch_size: int,
                     sharding) -> None:
  """An eval source whose fields' shapes or dtypes differ from the train data's: its eval step,
  traced (not compiled) now; an error is one line naming both."""
  batch = {k: jax.ShapeDtypeStruct((batch_size,) + s.shape[1:], s.dtype, sharding=sharding)
           for k, s in element_spec(records).items()}
  try:
    jax.eval_shape(steps.evaluate, state, batch)
  except (TypeError, ValueError, KeyError, IndexError, DataError) as e:  # DataError: the task's
    shown = lambda r: ', '.join(f'{k} {s.dtype}{list(s.shape)}' for k, s in sorted(r.spec.items()))
    raise DataError(f'the {records.name} data ({shown(records)}) does not run through the model '
                    f'trained on {shown(train)}: {type(e).__name__}: {first_line(e, 200)}; give '
                    'it the train data\'s shapes and dtypes') from None


def _objective(cfg: Config, model, task):
  """The config's model (with LoRA adapters if asked) and task (DPO over preference pairs, GRPO
  over sampled completions)."""
  if model is not None and cfg.precision.matmul != 'default':
    raise ConfigError(f'precision.matmul={cfg.precision.matmul!r} applies to the model the '
                      "config builds, not a model passed in; pass models.build(cfg.model, ..., "
                      "matmul='float8') and precision.matmul='default'")
  model = lora.adapt(model or models.build(cfg.model, cfg.precision.compute_dtype,
                                           cfg.row_tokens, cfg.precision.matmul), cfg.lora)
  if cfg.data.name == 'preference':
    return preference.WithReference(model), task or preference.Dpo(cfg.dpo.beta)
  if cfg.data.name == 'prompts':
    g = cfg.grpo
    if g.beta:  # the KL penalty's reference: the starting weights (LoRA: the base)
      model = preference.WithReference(model, pairs=False)
    return model, task or grpo.Grpo(g.epsilon, g.clip_high, g.beta, g.temperature)
  return model, task or models.task(cfg.model)


def _tokens(model, spec: dict) -> int:
  """Tokens per example of a model that counts them (language models), else 0."""
  count = getattr(model, 'tokens_per_example', None)
  return count(spec) if count is not None and getattr(model, 'splits_sequence', False) else 0


def _check_metric_names(cfg: Config, evals: dict[str, Records], tasks: set[str]) -> None:
  """best_metric / early_stop.metric name an eval source or task that writes records
  ('split/name'); `tasks`: those of data.eval_tasks and data.eval_harness (a tag's tasks)."""
  evals = {**evals, **dict.fromkeys(sorted(tasks))}
  for field, metric in (('best_metric', cfg.best_metric), ('early_stop.metric',
                                                           cfg.early_stop.metric)):
    if not metric:
      continue
    split = metric.rpartition('/')[0] or 'eval'
    if split not in evals:
      raise ConfigError(f'{field}={metric!r} names eval data {split!r}, but the run evaluates '
                        f'{sorted(evals) or "nothing"}; use one of them, e.g. '
                        f'{next(iter(evals), "eval")}/accuracy')


@dataclasses.dataclass
class Plan:
  """A run's compiled-on-demand steps over abstract state and batch: nothing is created."""
  cfg: Config
  steps: Steps
  state: state_lib.TrainState  # ShapeDtypeStructs with shardings
  batch: dict  # the train batch [B, ...] as ShapeDtypeStructs with the batch sharding
  mesh: Mesh  # with step_spec and batch_sharding: what memory.preflight reads, as from a Setup
  step_spec: dict
  batch_sharding: Any

  def compile(self, variant: Variant = Variant(full_batch=True)) -> CompileInfo:
    """Compile seconds and per-device memory of a train-step variant (the loop's by default)."""
    return self.steps.compile(variant, self.state, self.batch)


def plan(cfg: Config, spec: dict, devices: Sequence[jax.Device] | None = None, model: Any = None,
         task: Any = None, tx: Any = None) -> Plan:
  """The steps of `cfg` for data of element spec `spec` ({field: ShapeDtypeStruct((1, ...))}),
  with an abstract state: the memory of a model too large to create on this host."""
  cfg = hf_config.from_directory(cfg)  # model.name='hf': the model restore_from's config.json
  parallel = mesh_lib.Parallelism.from_config(cfg.mesh, devices, cfg.dcn_mesh)
  parallel.check_batch_sizes(cfg)
  mesh = parallel.mesh
  model, task = _objective(cfg, model, task)
  tx = tx or optim.build(cfg)[0]
  parallel.check_model(model, _tokens(model, spec))
  lay = state_lib.layout(model, tx, spec, cfg, mesh)
  batch_sharding = parallel.rows
  steps = spmd.build(model, task, tx, cfg, mesh, lay, batch_sharding)
  batch = {k: jax.ShapeDtypeStruct((cfg.global_batch_size,) + s.shape[1:], s.dtype,
                                   sharding=batch_sharding)
           for k, s in spec.items() if k != records_lib.MASK}
  return Plan(cfg, steps, state_lib.abstract(lay, model, tx, spec, cfg.seed), batch, mesh, spec,
              batch_sharding)


def _dtypes(tree: Any) -> list[str]:
  return sorted({np.dtype(x.dtype).name for x in jax.tree.leaves(tree)})


def run_info(run: Setup) -> dict:
  """The contents of run.json (before compilation)."""
  cfg, mesh, lay = run.cfg, run.mesh, run.layout
  return {
      'config': cfg.to_dict(),
      'mesh': mesh_lib.axis_sizes(mesh),
      # Axes whose devices span slices or processes (a hybrid mesh puts only dcn_mesh's there),
      # and each mesh position's process.
      'dcn_axes': mesh_lib.crossing_axes(mesh, cfg.dcn_mesh.granules if cfg.dcn_mesh.granules > 1
                                         else None),
      'mesh_process_index': np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
      'num_devices': mesh.size,
      'num_processes': jax.process_count(),
      'step_mode': cfg.step_mode,
      'param_specs': sharding_lib.spec_lists(lay.param_specs),
      'param_split': sharding_lib.split_summary(lay.param_specs, mesh),
      'fsdp_replicated': lay.replicated,
      'weight_decay_paths': optim.decayed_paths(cfg, run.state.params),
      'state_dtypes': {name: _dtypes(getattr(run.state, name))
                       for name in ('params', 'opt_state', 'mutable')},
      'state_bytes_per_device': shard_bytes(run.state),
      'state_bytes_per_device_by_part': _state_parts(run.state),
      'data': {'train': {'examples': len(run.train_data), 'fields': _spec_json(run.train_data)},
               **{name: {'examples': len(r)} for name, r in run.eval_data.items()}},
      'versions': {'disttrain': disttrain.__version__, 'jax': jax.__version__,
                   'python': platform.python_version()},
      'platform': mesh.devices.flat[0].platform,
      'device_kind': mesh.devices.flat[0].device_kind,
      'xla_flags': xla_flags.applied(),  # with the launcher's GPU defaults it added
      **({'pipeline': _pipeline_info(run)} if run.parallel.stages > 1 else {}),
      **({'loss': run.model.loss_info(run.step_spec or element_spec(run.train_data))}
         if hasattr(run.model, 'loss_info') else {}),
  }


def _state_parts(state: state_lib.TrainState) -> dict:
  """Per-device bytes of the parameters, the optimizer state and the other collections (LoRA's
  frozen base apart): what an adapter run saves is read here."""
  mutable = dict(state.mutable) if isinstance(state.mutable, dict) else {'': state.mutable}
  frozen = mutable.pop(state_lib.FROZEN, None)
  return {'params': shard_bytes(state.params), 'opt_state': shard_bytes(state.opt_state),
          'mutable': shard_bytes(mutable), **({'frozen': shard_bytes(frozen)} if frozen else {})}


def _pipeline_info(run: Setup) -> dict:
  """Stages, micro-batches, GPipe's bubble, and the state bytes of the staged layers (split over
  the stage axis) and of the rest, whole and per device."""
  axis, parts = run.parallel.stage_axis, {'layer': [], 'other': []}
  for leaf in jax.tree.leaves(run.state):
    parts['layer' if axis in sharding_lib.spec_axes(leaf.sharding.spec) else 'other'].append(leaf)
  s, m = run.parallel.stages, run.cfg.grad_accum_steps
  out = {'stages': s, 'micro_batches': m, 'bubble_fraction': pipeline.bubble_fraction(s, m)}
  for name, leaves in parts.items():
    out[f'{name}_state_bytes'] = sum(int(x.nbytes) for x in leaves)
    out[f'{name}_state_bytes_per_device'] = shard_bytes(leaves)
  return out


def _spec_json(records: Records) -> dict:
  return {k: {'shape': list(s.shape), 'dtype': np.dtype(s.dtype).name}
          for k, s in records.spec.items()}


def throughput(run: Setup) -> metrics.Throughput:
  """Tokens/s and MFU fields for models that count them (models.LanguageModel), else none."""
  flops = getattr(run.model, 'flops_per_example', None)
  tokens = getattr(run.model, 'tokens_per_example', None)
  spec = run.step_spec or element_spec(run.train_data)
  count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
  # LoRA's base is frozen state, not parameters: its weights still run every token.
  lora_base = isinstance(run.model, lora.LoraModel) or getattr(run.model, 'adapters', False)
  mutable = getattr(run.state, 'mutable', None) or {}
  frozen = count(mutable.get(state_lib.FROZEN, {})) if lora_base else 0
  num_params = count(run.state.params) + frozen
  device = run.mesh.devices.flat[0]
  peak = run.cfg.peak_flops_per_device or metrics.peak_flops(device.device_kind)
  return metrics.Throughput(tokens(spec) if tokens else None,
                            flops(spec, num_params, frozen) if flops else None,
                            peak * run.mesh.size if peak else None)

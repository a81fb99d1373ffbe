"""Experiment trackers as built-in callbacks: MLflow and Weights & Biases (config `tracking.*`).

Process 0 logs the resolved config once per tracker run, every train and eval record as
'<split>/<name>' at the record's step (as TensorBoard shows them), and the final summary.

One tracker run per disttrain run, across kills and restarts: the tracker's run id is the
callback's state, saved in every checkpoint, so a resumed attempt reopens the same run. A resumed
attempt trains again the steps between its checkpoint and the kill, which the tracker may already
hold; it asks the tracker for the last step it holds of each split (MLflow: the metric history;
W&B: the .wandb files of that run id under the W&B directory) and skips records at or below it.
The skipped steps are equal: disttrain's resume is bit-exact, so every value computed from the
model and data matches; only wall-clock fields (examples_per_sec, data_wait_fraction) keep the
killed attempt's measurement, as metrics.superseded.jsonl does. A tracker can also lag behind
metrics.jsonl (W&B writes its file in the background and a SIGKILL loses the unwritten tail, even
before the checkpoint), so on opening the run it first logs the metrics.jsonl records beyond what
it holds: the tracker ends with each step once, equal to metrics.jsonl. A run killed before its
first checkpoint starts over, and so does its tracker run (a new one).

mlflow and wandb are optional extras (pip install 'disttrain[mlflow]' / '[wandb]'), imported only
when a tracker is enabled.
"""

import glob
import json
import logging
import os
import struct
import time
import zlib

import jax

from disttrain.errors import ConfigError, first_line
from disttrain.operating.callbacks import Callback


# Libraries that log their own INFO lines on every process (MLflow's database setup, botocore's
# credential lookup): held to the run's own level, WARNING unless --verbosity asks for more.
_CHATTY = ('mlflow', 'alembic', 'botocore', 'urllib3', 'gcsfs', 's3fs', 'fsspec')


def quiet_libraries() -> None:
  level = max(logging.getLogger().getEffectiveLevel(), logging.WARNING) if not _asked() else \
      logging.getLogger().getEffectiveLevel()
  for name in _CHATTY:
    logging.getLogger(name).setLevel(level)


def _asked() -> bool:
  """The user asked for INFO lines (absl --verbosity >= 0, or -v)."""
  try:
    from absl import flags  # pylint: disable=g-import-not-at-top
    return flags.FLAGS.is_parsed() and flags.FLAGS['verbosity'].present > 0
  except (ImportError, KeyError):
    return False


def from_config(cfg, workdir: str, local: str | None = None) -> list:
  """The trackers cfg.tracking enables, in a fixed order (their checkpointed state is matched by
  position). `local`: where process 0's metrics.jsonl is written (a bucket workdir's mirror)."""
  out = []
  if cfg.tracking.mlflow_uri:
    out.append(MlflowTracker(cfg, workdir, local))
  if cfg.tracking.wandb_mode:
    out.append(WandbTracker(cfg, workdir, local))
  return out


def _import(module: str, field: str, extra: str):
  # Every process imports, so a missing package fails all of them at the same point.
  try:
    return __import__(module)
  except ImportError as e:
    raise ConfigError(f'{field} is set but {module} cannot be imported ({first_line(e)}); pip '
                      f"install 'disttrain[{extra}]' or set {field}=''") from None


def _flat(tree: dict, prefix: str = '') -> dict:
  """{'model': {'hidden': 8}} -> {'model.hidden': 8}."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f'{prefix}{key}.'))
    else:
      out[prefix + key] = value
  return out


def _values(record: dict) -> dict:
  """A record's numbers named '<split>/<name>', as metrics.Writer names TensorBoard's scalars."""
  return {f'{record["split"]}/{name}': float(value) for name, value in record.items()
          if name not in ('step', 'split') and isinstance(value, (int, float))}


def _jsonl(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  out = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:  # a line cut short by a kill: the writer moves it aside
        pass
  return out


class _Tracker(Callback):
  """Run id in checkpoints, the catch-up from metrics.jsonl, the skip of held steps."""

  def __init__(self, cfg, workdir: str, local: str | None = None):
    self.cfg, self.workdir, self.local = cfg, workdir, local or workdir
    self.run_id = ''  # '' until the tracker run is created or restored from a checkpoint
    self.primary = jax.process_index() == 0
    self.name = cfg.tracking.run_name or os.path.basename(os.path.normpath(workdir))
    self._held = None  # {split: last step the tracker holds} once the run is open

  def state(self) -> dict:
    self._open()  # a checkpoint saved before the first record still names the run
    return {'run_id': self.run_id}

  def restore(self, state: dict) -> None:
    self.run_id = state.get('run_id', '')  # opened at the first hook: metrics.jsonl is then final

  def _open(self) -> None:
    if self._held is not None or not self.primary:
      return
    self._held = self._start()
    # The loop has superseded metrics.jsonl by now: it holds the steps up to the checkpoint.
    for record in _jsonl(os.path.join(self.local, 'metrics.jsonl')):
      self._add(record)

  def _add(self, record: dict) -> None:
    split, step = record['split'], record['step']
    if step <= self._held.get(split, -1):
      return  # held already: logged by a killed attempt, equal (see the module docstring)
    self._log(step, _values(record))
    self._held[split] = step

  def on_train_record(self, record: dict) -> None:
    if self.primary:
      self._open()
      self._add(record)

  def on_eval(self, record: dict) -> None:
    self.on_train_record(record)

  def on_end(self, result) -> None:
    if not self.primary:
      return
    self._open()
    final = {}
    for record in result.records:  # the last eval of each source
      if record['split'] != 'train':
        final.update({f'final/{k}': v for k, v in _values(record).items()})
    final['time/wall_seconds'] = float(result.time.get('wall_seconds', 0.0))
    # A finished run relaunched (a requeue) ends at the step it held: its finals are logged.
    final = {k: v for k, v in final.items()
             if result.step > self._held.get(k.partition('/')[0], -1)}
    self._finish(result.step, final, result.stopped_by)

  def _start(self) -> dict:
    """Opens the run (self.run_id, else a new one); returns {split: last held step}."""
    raise NotImplementedError

  def _log(self, step: int, values: dict) -> None:
    raise NotImplementedError

  def _finish(self, step: int, final: dict, stopped_by: str) -> None:
    raise NotImplementedError


def _held(steps: list[tuple[str, int]]) -> dict:
  """[(metric name, step)] -> {split: last step}."""
  out = {}
  for key, step in steps:
    split = key.partition('/')[0]
    out[split] = max(out.get(split, -1), step)
  return out


class MlflowTracker(_Tracker):
  """An MLflow run through MlflowClient (a sqlite:// URI or a tracking server)."""

  def __init__(self, cfg, workdir: str, local: str | None = None):
    super().__init__(cfg, workdir, local)
    _import('mlflow', 'tracking.mlflow_uri', 'mlflow')
    self.client = None

  def _start(self) -> dict:
    import mlflow  # pylint: disable=g-import-not-at-top
    from mlflow.entities import Param  # pylint: disable=g-import-not-at-top
    quiet_libraries()
    self.client = client = mlflow.MlflowClient(self.cfg.tracking.mlflow_uri)
    if self.run_id:
      try:
        run = client.get_run(self.run_id)
      except mlflow.exceptions.MlflowException as e:
        print(f'warning: MLflow run {self.run_id} cannot be reopened ({first_line(e)}); '
              'starting a new one', flush=True)
      else:
        client.update_run(self.run_id, status='RUNNING')
        return _held([(key, m.step) for key in run.data.metrics
                      for m in client.get_metric_history(self.run_id, key)])
    project = self.cfg.tracking.project
    experiment = client.get_experiment_by_name(project)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(project)
    self.run_id = client.create_run(experiment_id, run_name=self.name,
                                    tags={'workdir': self.workdir}).info.run_id
    params = [Param(k, str(v)[:6000]) for k, v in _flat(self.cfg.to_dict()).items()]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
      client.log_batch(self.run_id, params=params[i:i + 100])
    return {}

  def _metrics(self, step: int, values: dict) -> list:
    from mlflow.entities import Metric  # pylint: disable=g-import-not-at-top
    now = int(time.time() * 1000)
    return [Metric(key, value, now, step) for key, value in values.items()]

  def _log(self, step: int, values: dict) -> None:
    self.client.log_batch(self.run_id, metrics=self._metrics(step, values))  # one transaction

  def _finish(self, step: int, final: dict, stopped_by: str) -> None:
    self.client.log_batch(self.run_id, metrics=self._metrics(step, final))
    self.client.set_tag(self.run_id, 'stopped_by', stopped_by)
    self.client.set_terminated(self.run_id, 'FINISHED')


_WANDB_BLOCK = 32768  # the .wandb file is a LevelDB log: 32 KiB blocks of checksummed chunks


def wandb_records(path: str):
  """wandb's protobuf Records of one .wandb file, up to the first torn or corrupt chunk (a killed
  writer leaves one). wandb >= 0.2x no longer ships a Python reader (wandb-core writes the file)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    data = f.read()
  pos, pending = 7, b''  # the 7-byte header: ':W&B', magic, version
  while pos + 7 <= len(data):
    if _WANDB_BLOCK - pos % _WANDB_BLOCK < 7:  # a block's tail too short for a header is padding
      pos += _WANDB_BLOCK - pos % _WANDB_BLOCK
      continue
    crc, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
    chunk = data[pos + 7:pos + 7 + length]
    if len(chunk) < length or zlib.crc32(bytes([kind]) + chunk) != crc:
      return
    pos += 7 + length
    pending = chunk if kind in (1, 2) else pending + chunk  # 1 full, 2 first, 3 middle, 4 last
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      yield record


def wandb_history(wandb_dir: str, run_id: str, skip: str = '') -> list[dict]:
  """The history rows of every .wandb file of a run id in a W&B directory (DIR/wandb), each
  attempt's own file, oldest first; `skip`: one attempt's directory left out."""
  rows = []
  for path in sorted(glob.glob(os.path.join(wandb_dir, f'*-{run_id}', '*.wandb'))):
    if skip and os.path.dirname(path) == os.path.normpath(skip):
      continue
    for record in wandb_records(path):
      if record.WhichOneof('record_type') == 'history':
        rows.append({'/'.join(item.nested_key) or item.key: json.loads(item.value_json)
                     for item in record.history.item})
  return rows


class WandbTracker(_Tracker):
  """A W&B run (online, or offline: files under the W&B directory, `wandb sync` uploads them)."""

  def __init__(self, cfg, workdir: str, local: str | None = None):
    super().__init__(cfg, workdir, local)
    _import('wandb', 'tracking.wandb_mode', 'wandb')
    self.dir = cfg.tracking.wandb_dir or (workdir if '://' not in workdir else None)
    self.run = None

  def _start(self) -> dict:
    import wandb  # pylint: disable=g-import-not-at-top
    resumed = self.run_id
    if self.dir:
      os.makedirs(self.dir, exist_ok=True)
    self.run = wandb.init(project=self.cfg.tracking.project, name=self.name, dir=self.dir,
                          id=self.run_id or None, resume='allow', mode=self.cfg.tracking.wandb_mode,
                          config=_flat(self.cfg.to_dict()))
    self.run_id = self.run.id
    # Our step is a logged field: each record is its own row, whole (two splits share steps).
    self.run.define_metric('*', step_metric='step')
    if not resumed:
      return {}
    rows = wandb_history(self.run.settings.wandb_dir, self.run_id, skip=self.run.settings.sync_dir)
    return _held([(key, row['step']) for row in rows for key in row
                  if '/' in key and 'step' in row])

  def _log(self, step: int, values: dict) -> None:
    self.run.log({'step': step, **values})

  def _finish(self, step: int, final: dict, stopped_by: str) -> None:
    self.run.summary.update({**final, 'final_step': step, 'stopped_by': stopped_by})
    self.run.finish()

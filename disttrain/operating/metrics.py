"""Run outputs: DIR/metrics.jsonl, DIR/run.json, TensorBoard events, console lines.

Only process 0 writes; on the other processes a Writer is silent. metrics.jsonl and run.json are
public interfaces (docs/outputs.md): add fields freely, rename or remove only with a deprecation.
"""

import importlib
import json
import math
import os
import re
import sys
import time

from disttrain.errors import ConfigError
from disttrain.storage import urls


# What tensorboardX imports if installed, for what we never ask of it: torch to accept its tensors
# (we write floats), boto3 and google-cloud-storage for s3:// and gs:// log dirs (ours is local; a
# bucket workdir's files go through storage.urls.Mirror). 1.5 s and 0.5-0.7 s of every start.
_UNUSED_BY_TENSORBOARDX = ('torch', 'boto3', 'google.cloud.storage')


def _summary_writer(**kwargs):
  """tensorboardX's SummaryWriter, imported with the modules above hidden (an ImportError, which
  tensorboardX expects) unless something imported them already; they import normally after."""
  if 'tensorboardX' not in sys.modules:
    hidden = [name for name in _UNUSED_BY_TENSORBOARDX if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden))
    try:
      importlib.import_module('tensorboardX')
    finally:
      for name in hidden:
        del sys.modules[name]
  from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  return SummaryWriter(**kwargs)


# A bucket workdir's newest train step, uploaded within seconds (records go every 30 s): how far
# an attempt killed between uploads trained, for the next one's restore event and goodput.
PROGRESS = 'progress.json'
_KEPT = ('metrics.jsonl', 'metrics.superseded.jsonl', PROGRESS)  # a bucket mirror's start


class Writer:
  """Appends records to metrics.jsonl and TensorBoard, prints progress; process 0 only.

  A run that starts at step S (resumed, or started again) first moves the records of steps after
  S, written by an attempt that died before its next checkpoint, from metrics.jsonl to
  metrics.superseded.jsonl, and TensorBoard purges its events from step S + 1 on: every reader
  then sees each step once, as if the run had never been interrupted. In a bucket workdir the
  files are written to `local` (urls.Mirror) and uploaded at most every 30 s, at every
  checkpoint (`sync`) and at the end.
  """

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    self.workdir = workdir
    self.local = workdir  # where this process writes files (a bucket's local mirror)
    self._jsonl = self._tb = self._mirror = None
    self._present = set()  # (step, split) of records kept at the first step: never written twice
    if enabled:
      try:
        self._mirror = urls.Mirror(workdir, pull=_KEPT)
        self.local = self._mirror.local
        os.makedirs(self.local, exist_ok=True)
        with open(os.path.join(self.local, 'metrics.jsonl'), 'a', encoding='utf-8'):
          pass
      except OSError as e:
        raise ConfigError(f'workdir={workdir!r} cannot be used ({e.strerror}); pass a writable '
                          'directory path') from e

  def start(self, first_step: int) -> int | None:
    """Opens the outputs for a run whose first new step is first_step + 1; returns the last
    step of the records it moved aside (steps a killed attempt trained past its checkpoint)."""
    if not self.enabled:
      return None
    path = os.path.join(self.local, 'metrics.jsonl')
    moved, self._present = supersede(path, first_step)
    progress = _read_step(os.path.join(self.local, PROGRESS))
    if progress is not None and progress > first_step:
      moved.append(progress)
      # Counted now: an attempt stopped before its first record must not count them again.
      self._progress(first_step)
    self._jsonl = open(path, 'a', encoding='utf-8')
    # tensorboardX names the file by the second and truncates it: a relaunch in the same second
    # erased the last attempt's events. Nanoseconds keep names unique and in order (purges).
    self._tb = _summary_writer(logdir=self.local, purge_step=first_step + 1,
                               filename_suffix=f'.{time.time_ns()}')
    self.sync()
    return max(moved, default=None)

  def sync(self, force: bool = True) -> None:
    """Uploads what changed (bucket workdirs; a no-op for local ones)."""
    if self._mirror is not None:
      self._mirror.push(force)

  def write_run(self, info: dict) -> None:
    """DIR/run.json: resolved config and layout, so anyone can see how the run was laid out."""
    if self.enabled:
      with open(os.path.join(self.local, 'run.json'), 'w', encoding='utf-8') as f:
        json.dump(info, f, indent=2, sort_keys=True)
      self.sync()

  def write(self, record: dict) -> None:
    """One JSON line; numeric fields also go to TensorBoard as '<split>/<name>'."""
    # A finished run relaunched evaluates its last step again: its record is there already.
    if not self.enabled or (record['step'], record['split']) in self._present:
      return
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    for name, value in record.items():
      if name not in ('step', 'split') and isinstance(value, (int, float)):
        self._tb.add_scalar(f'{record["split"]}/{name}', value, record['step'])
    self._tb.flush()
    if record['split'] == 'train':
      self._progress(record['step'])
    self.sync(force=False)

  def _progress(self, step: int) -> None:
    """A bucket workdir's progress marker: this attempt trained through `step`."""
    if self._mirror is not None and self._mirror.bucket:
      with open(os.path.join(self.local, PROGRESS), 'w', encoding='utf-8') as f:
        json.dump({'step': step, 'time': round(time.time(), 3)}, f)  # one small write
      self._mirror.push(names=(PROGRESS,))

  def print(self, line: str) -> None:
    if self.enabled:
      print(line, flush=True)

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
      self._tb.close()
    self.sync()
    if self._mirror is not None:
      self._mirror.close()


def _read_step(path: str) -> int | None:
  """The step in a progress marker, or None (none yet, or cut short)."""
  try:
    with open(path, encoding='utf-8') as f:
      return int(json.load(f)['step'])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def supersede(path: str, first_step: int) -> tuple[list[int], set[tuple[int, str]]]:
  """Moves the lines of steps after first_step (and any line cut short by a kill) from `path`
  to its .superseded.jsonl sibling, appended there before `path` is replaced; returns the steps
  of the records moved and the (step, split) of the records kept at first_step."""
  if not os.path.isfile(path):
    return [], set()
  keep, moved, steps, present = [], [], [], set()
  with open(path, 'rb') as f:  # bytes: a line of bad UTF-8 is moved aside as it is
    for line in f:
      try:
        record = json.loads(line)
        step = record['step']
        if not isinstance(step, int):
          raise TypeError(step)
      except (ValueError, KeyError, TypeError):  # ValueError: bad JSON or bad UTF-8
        moved.append(line if line.endswith(b'\n') else line + b'\n')
        continue
      if step <= first_step:
        keep.append(line)
        if step == first_step:
          present.add((step, record.get('split')))
      else:
        moved.append(line)
        steps.append(step)
  if moved:
    with open(path[:-len('.jsonl')] + '.superseded.jsonl', 'ab') as f:
      f.writelines(moved)
    with open(path + '.tmp', 'wb') as f:
      f.writelines(keep)
    os.replace(path + '.tmp', path)
  return steps, present


# Dense bf16 peak FLOP/s per device (vendor figures), matched against jax's device_kind.
PEAK_FLOPS = {
    'TPU v4': 275e12,
    'TPU v5 lite': 197e12,  # v5e
    'TPU v5e': 197e12,
    'TPU v5p': 459e12,
    'TPU v5': 459e12,
    'TPU v6 lite': 918e12,  # Trillium
    'TPU v6e': 918e12,
    'H200': 989e12,
    'GH200': 989e12,  # Grace Hopper: the H100's tensor cores
    'H100': 989e12,  # SXM
    'H100 PCIe': 756e12,
    'A100': 312e12,
    'L40S': 362e12,
    'L40': 181e12,
    'L4': 121e12,
    'A10G': 125e12,
}


def peak_flops(device_kind: str) -> float | None:
  """The table's peak for a device kind ('NVIDIA H100 80GB HBM3' -> 989e12), else None."""
  for name, flops in sorted(PEAK_FLOPS.items(), key=lambda item: -len(item[0])):
    # Whole words: 'L4' is not the L40S, 'TPU v5' not the v5p.
    if re.search(rf'\b{re.escape(name)}\b', device_kind, re.IGNORECASE):
      return flops
  return None


class Throughput:
  """Tokens/s and model FLOPs utilisation, for models that count tokens and FLOPs."""

  def __init__(self, tokens_per_example: int | None, flops_per_example: float | None,
               peak_flops_total: float | None):
    self.tokens_per_example = tokens_per_example
    self.flops_per_example, self.peak = flops_per_example, peak_flops_total

  def fields(self, examples_per_sec: float) -> dict:
    out = {}
    if self.tokens_per_example:
      out['tokens_per_sec'] = examples_per_sec * self.tokens_per_example
    if self.flops_per_example and self.peak:
      out['mfu'] = examples_per_sec * self.flops_per_example / self.peak
    return out


def format_eta(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  minutes, secs = divmod(int(seconds), 60)
  return f'{minutes}m{secs:02d}s' if minutes else f'{secs}s'

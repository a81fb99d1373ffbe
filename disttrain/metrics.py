"""Run outputs: DIR/metrics.jsonl, DIR/run.json, TensorBoard events, console lines.

Only process 0 writes; on the other processes a Writer is silent. metrics.jsonl and run.json are
public interfaces (README, "Outputs"): add fields freely, rename or remove only with a deprecation.
"""

import json
import math
import os
import time

from tensorboardX import SummaryWriter

from disttrain.errors import ConfigError


class Writer:
  """Appends records to metrics.jsonl and TensorBoard, prints progress; process 0 only."""

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    self.workdir = workdir
    self._jsonl = self._tb = None
    if enabled:
      try:
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', encoding='utf-8')
      except OSError as e:
        raise ConfigError(f'workdir={workdir!r} cannot be used ({e.strerror}); pass a writable '
                          'directory path') from e
      self._tb = SummaryWriter(logdir=workdir)

  def write_run(self, info: dict) -> None:
    """DIR/run.json: resolved config and layout, so anyone can see how the run was laid out."""
    if self.enabled:
      with open(os.path.join(self.workdir, 'run.json'), 'w', encoding='utf-8') as f:
        json.dump(info, f, indent=2, sort_keys=True)

  def write(self, record: dict) -> None:
    """One JSON line; numeric fields also go to TensorBoard as '<split>/<name>'."""
    if not self.enabled:
      return
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    for name, value in record.items():
      if name not in ('step', 'split') and isinstance(value, (int, float)):
        self._tb.add_scalar(f'{record["split"]}/{name}', value, record['step'])
    self._tb.flush()

  def print(self, line: str) -> None:
    if self.enabled:
      print(line, flush=True)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


class Meter:
  """Examples/s and ETA between consecutive train records."""

  def __init__(self, start_step: int, total_steps: int):
    self.total_steps = total_steps
    self._step, self._time = start_step, time.perf_counter()

  def tick(self, step: int, examples: int) -> tuple[float, float]:
    """(examples per second since the last tick, seconds left at that pace)."""
    now = time.perf_counter()
    elapsed = max(now - self._time, 1e-9)
    steps_per_sec = (step - self._step) / elapsed
    self._step, self._time = step, now
    eta = (self.total_steps - step) / steps_per_sec if steps_per_sec > 0 else math.inf
    return examples / elapsed, eta


def format_eta(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  minutes, secs = divmod(int(seconds), 60)
  return f'{minutes}m{secs:02d}s' if minutes else f'{secs}s'

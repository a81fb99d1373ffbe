"""launch/configs/mnist_mlp.py plus test hooks chosen by environment variables.

  STOP_AT=N       a callback asks to stop when it sees the train record of step N
  RAISE_IN=hook   a callback raises in that hook (on_train_record, on_eval, on_checkpoint); with
                  EXIT=S, process FAIL_PROCESS calls sys.exit(S) there instead
  HANG_AFTER=N    process 1's data source sleeps forever from its read number N on
  SLOW_READS=S    every batch read sleeps S seconds (a slow data source); with SLOW_PROCESS=P,
                  only process P's reads
  FAIL_AT=setup|N process 1 (FAIL_PROCESS) fails with a DataError in get_data, or on its read N
"""

import os
import sys
import time

import jax

import disttrain
from disttrain.data import sources

_HERE = os.path.dirname(os.path.abspath(__file__))
get_config = __import__('runpy').run_path(
    os.path.join(_HERE, '..', '..', 'launch', 'configs', 'mnist_mlp.py'))['get_config']


class StopAt(disttrain.Callback):
  """Asks to stop on the first train record at or after `step` (the run ends one step later)."""

  def __init__(self, step: int):
    self.step = step

  def on_train_record(self, record):
    if record['step'] >= self.step:
      return disttrain.Stop(f'saw step {record["step"]}')
    return None


class Boom(disttrain.Callback):
  def __init__(self, hook: str):
    setattr(self, hook, self._boom)

  def _boom(self, *args):
    if os.environ.get('EXIT'):
      if _fails():
        sys.exit(int(os.environ['EXIT']))
      return
    raise RuntimeError(f'boom with {type(args[0]).__name__}')


def get_callbacks(config):
  del config
  callbacks = []
  if os.environ.get('STOP_AT'):
    callbacks.append(StopAt(int(os.environ['STOP_AT'])))
  if os.environ.get('RAISE_IN'):
    callbacks.append(Boom(os.environ['RAISE_IN']))
  return callbacks


def sleep_forever():
  """What a hung data source looks like: a read that never returns."""
  while True:
    time.sleep(3600)


class Reads:
  """Digits as a source whose batched reads can stall (HANG_AFTER) or crawl (SLOW_READS)."""

  def __init__(self, arrays: dict):
    self.arrays, self.reads = arrays, 0
    self.hang_after = int(os.environ.get('HANG_AFTER', '-1'))
    self.slow = float(os.environ.get('SLOW_READS', '0'))
    if os.environ.get('SLOW_PROCESS', str(jax.process_index())) != str(jax.process_index()):
      self.slow = 0.0
    self.fail_at = int(os.environ.get('FAIL_AT', '-1').replace('setup', '-1'))

  def __len__(self):
    return len(self.arrays['label'])

  def __getitem__(self, i):
    return {k: v[i] for k, v in self.arrays.items()}

  def __getitems__(self, indices):
    self.reads += 1
    if jax.process_index() == 1 and 0 <= self.hang_after <= self.reads:
      sleep_forever()
    if _fails() and self.reads == self.fail_at:
      raise disttrain.DataError(f'read {self.reads} of process {jax.process_index()} failed '
                                '(FAIL_AT)')
    time.sleep(self.slow)
    return [self[int(i)] for i in indices]


def _fails() -> bool:
  return jax.process_index() == int(os.environ.get('FAIL_PROCESS', '1'))


def get_data(config):
  if _fails() and os.environ.get('FAIL_AT') == 'setup':
    raise disttrain.DataError("this process's data could not be read (FAIL_AT=setup)")
  digits = sources.build(config)
  return {'train_data': Reads(digits['train_data']), 'eval_data': digits['eval_data']}

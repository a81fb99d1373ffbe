"""Steps and seconds to an eval loss: AdamW against Muon on the tiny Llama, in one process.

  python benchmarks/optimizers.py [--target_loss=2.25] [--muon_lr=0.02 ...] [--json=out.json]

launch/configs/llama.py's tiny size (4 x 128, byte-level text of the standard library's source,
batch 32 x 128, warm-up 20 then cosine over 300 steps, weight decay 0.1) on 1 CPU device, the
same seed and batches for all: AdamW at the recipe's 3e-3, and optimizer='muon' at each --muon_lr
for the blocks' matrices with its AdamW part (embeddings, norms) at 3e-3. A run stops at the
first eval (every --eval_every steps, on 64 windows) whose loss is at most --target_loss; its
seconds are the wall time from the start of disttrain.train (set-up and compilation included)
to that eval.
"""

import json
import sys
import tempfile
import time

from absl import app, flags

import recipes

_TARGET = flags.DEFINE_float('target_loss', 2.25, 'Eval loss to reach (AdamW: 200-250 steps).')
_MUON_LR = flags.DEFINE_multi_float('muon_lr', [0.02], "Muon's peak learning rate (its "
                                    'matrices); repeat the flag for a row per value.')
_EVAL_EVERY = flags.DEFINE_integer('eval_every', 10, 'Steps between evals.')
_STEPS = flags.DEFINE_integer('steps', 300, 'The schedule length and the most steps a run takes.')
_JSON = flags.DEFINE_string('json', None, 'Write the rows here.')


class _TargetLoss:
  """Stops the run at the first eval whose loss is at most `target`; remembers when."""

  def __init__(self, target: float):
    self.target, self.start, self.step, self.seconds = target, time.perf_counter(), None, None

  def on_eval(self, record: dict):
    import disttrain  # pylint: disable=g-import-not-at-top
    if record['split'] == 'eval' and record['loss'] <= self.target and self.step is None:
      self.step, self.seconds = record['step'], time.perf_counter() - self.start
      return disttrain.STOP
    return None


def run(name: str, overrides: dict) -> dict:
  """One training run of the tiny Llama until the target: its row."""
  import jax  # pylint: disable=g-import-not-at-top
  import disttrain  # pylint: disable=g-import-not-at-top
  cfg = recipes.config('llama', 'tiny', {
      'mesh.data': 1, 'num_train_steps': _STEPS.value, 'eval_every_steps': _EVAL_EVERY.value,
      'log_every_steps': _EVAL_EVERY.value, 'data.eval_examples': 64, 'eval_batch_size': 64,
      **overrides})
  target = _TargetLoss(_TARGET.value)
  with tempfile.TemporaryDirectory() as workdir:
    result = disttrain.train(cfg, workdir, devices=jax.devices()[:1], callbacks=[target])
  evals = [r for r in result.records if r['split'] == 'eval']
  return {'optimizer': name, 'learning_rate': cfg.learning_rate,
          'adam_learning_rate': cfg.adam_learning_rate or cfg.learning_rate,
          'target_loss': _TARGET.value, 'steps_to_target': target.step,
          'seconds_to_target': None if target.seconds is None else round(target.seconds, 1),
          'last_eval_step': evals[-1]['step'], 'last_eval_loss': round(evals[-1]['loss'], 4)}


def main(argv) -> None:
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  adamw = run('adamw', {})
  rows = [adamw] + [run('muon', {'optimizer': 'muon', 'learning_rate': lr,
                                 'adam_learning_rate': 3e-3}) for lr in _MUON_LR.value]
  for muon in rows[1:]:
    if adamw['steps_to_target'] and muon['steps_to_target']:
      muon['steps_vs_adamw'] = round(muon['steps_to_target'] / adamw['steps_to_target'], 3)
      muon['seconds_vs_adamw'] = round(muon['seconds_to_target'] / adamw['seconds_to_target'], 3)
  for row in rows:
    print(json.dumps(row), flush=True)
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(rows, f, indent=2)


if __name__ == '__main__':
  app.run(main)

"""Train and eval curves of one or several runs as one PNG (matplotlib; pip install '.[plot]').

  disttrain plot runs/a runs/b [--out=curves.png] [--metrics=loss,accuracy]

One panel per metric: train records as lines, eval records (every split: eval, val, a
downstream task's name, ...) as dashed lines with markers, one colour per run. `mixture` is one
panel of every `mixture/<source>` share (a line style per source). A resumed run's repeated
steps keep the last record of each step, as the run itself continued from it.
"""

import json
import os

from absl import flags

from disttrain import commandline
from disttrain.errors import DisttrainError
from disttrain.storage import urls

_STYLES = ('-', '--', ':', '-.')  # one per mixture source


def read(run_dir: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """{split: {metric: [(step, value), ...]}} from RUN_DIR/metrics.jsonl, last record per step."""
  path = urls.join(urls.resolve(run_dir), 'metrics.jsonl')  # a local directory or a bucket
  try:
    text = urls.read_text(path)
  except Exception as e:  # pylint: disable=broad-except  (a directory, not UTF-8, credentials)
    raise urls.unreadable(path, e) from None
  if text is None:
    raise FileNotFoundError(f'{path} does not exist; pass run directories (--workdir of a run)')
  latest: dict[tuple[str, int], dict] = {}
  for line in text.splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:  # a line being written by a live run
      continue
    if isinstance(record, dict) and isinstance(record.get('step'), int) and 'split' in record:
      latest[(str(record['split']), record['step'])] = record
  curves: dict[str, dict[str, list]] = {}
  for (split, step), record in sorted(latest.items(), key=lambda item: item[0][1]):
    for name, value in record.items():
      if name not in ('step', 'split') and isinstance(value, (int, float)):
        curves.setdefault(split, {}).setdefault(name, []).append((step, float(value)))
  return curves


def plot(run_dirs: list[str], out: str, metrics: list[str]) -> str:
  """Writes the PNG; returns its path."""
  import matplotlib  # pylint: disable=g-import-not-at-top  (optional extra)
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  runs = {run_dir: read(run_dir) for run_dir in run_dirs}
  has = lambda m, fields: m in fields or (m == 'mixture' and any(
      f.startswith('mixture/') for f in fields))
  shown = [m for m in metrics if any(has(m, c) for curves in runs.values() for c in curves.values())]
  if not shown:
    raise ValueError(f'none of the runs has a field in {metrics}; pass --metrics=loss,...')
  fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4), squeeze=False)
  colours = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for i, (run_dir, curves) in enumerate(runs.items()):
    label = os.path.basename(os.path.normpath(run_dir))
    colour = colours[i % len(colours)]
    for ax, metric in zip(axes[0], shown):
      for split, fields in curves.items():
        if metric == 'mixture':
          for k, name in enumerate(sorted(f for f in fields if f.startswith('mixture/'))):
            steps, values = zip(*fields[name])
            ax.plot(steps, values, color=colour, linestyle=_STYLES[k % len(_STYLES)],
                    label=f'{label} {name.partition("/")[2]}')
          continue
        if metric not in fields:
          continue
        steps, values = zip(*fields[metric])
        style = dict(linestyle='-', linewidth=1.2) if split == 'train' else dict(
            linestyle='--', marker='o', markersize=3)
        ax.plot(steps, values, color=colour, label=f'{label} {split}', **style)
  for ax, metric in zip(axes[0], shown):
    ax.set_title(metric)
    ax.set_xlabel('step')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  if os.path.isdir(out):
    raise ValueError(f'--out={out!r} is a directory; pass a file path, e.g. {out}/curves.png')
  out = out if os.path.splitext(out)[1] else f'{out}.png'  # what savefig writes: say that name
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def main(argv):
  run_dirs = argv[1:]
  if not run_dirs:
    commandline.fail('pass one or more run directories: disttrain plot RUN_DIR [RUN_DIR ...]')
  try:
    print(f'wrote {plot(run_dirs, flags.FLAGS.out, flags.FLAGS.metrics)}')
  except ImportError as e:
    commandline.fail(f'disttrain plot needs matplotlib ({e}); pip install \'.[plot]\'')
  except (FileNotFoundError, ValueError, DisttrainError) as e:
    commandline.fail(str(e))


if __name__ == '__main__':  # the flags here: importing plot() defines none (tests, notebooks)
  flags.DEFINE_string('out', 'curves.png', 'Where the PNG goes.')
  flags.DEFINE_list('metrics', ['loss', 'accuracy', 'accuracy_norm', 'exact_match', 'acc',
                               'acc_norm', 'mixture'],
                    'Record fields to plot, one panel each (a field no run has is left out; acc, '
                    'acc_norm: data.eval_harness tasks); mixture: the data.mixture shares of the '
                    'train records.')
  commandline.run(main)

"""Where a compiled step's time goes, per kind of operation, from jax.profiler traces (XLA:CPU).

  python benchmarks/op_profile.py --traced_steps=3 RUN_A/plugins/profile RUN_B/tensorboard/plugins/profile

Reads each directory's newest `*.xplane.pb`, keeps the events of its busiest compiled module (the
train step; a trace also holds the data pipeline's and the metrics' small programs) and sums
their time by kind: matrix products, collectives, copies, zero-fills (broadcasts), the layer
scan's stacking writes (dynamic-update-slice) and reads (dynamic-slice), the other fused
elementwise work. Containers (a `while` loop's own event spans its body's events) are left out
of the sums. Figures are milliseconds per step per device: the kinds' total over --traced_steps
traced steps and the devices that ran the module; `wall per step` is the traced steps' span
(the first operation's start to the last one's end) over their count, so its excess over the
total is time a device sat between operations (the host's dispatch, the data, another step). On 8 CPU devices sharing 2 cores a collective's
time is mostly waiting for the slowest device, so read it with the other rows.
benchmarks/peers.py --profile traces both trainers this way and prints the table.
"""

import collections
import glob
import os
import re
import sys
import warnings

from absl import app, flags

KINDS = ('matrix products', 'collectives', 'copies', 'zero-fills', 'stacking writes',
         'slice reads', 'other fused', 'other')
_CONTAINERS = ('while', 'call', 'conditional')
_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute',
                'all-to-all')


def kind(op: str) -> str | None:
  """The kind an HLO operation's event counts under; None for a container."""
  name = re.sub(r'\.\d+$', '', op)
  if name in _CONTAINERS:
    return None
  if name.startswith(_COLLECTIVES):
    return 'collectives'
  if name.startswith(('dot', 'ynn_fusion', 'onednn', 'convolution')) or 'gemm' in name:
    return 'matrix products'
  if 'dynamic-update-slice' in name:
    return 'stacking writes'
  if 'dynamic-slice' in name:
    return 'slice reads'
  if name.startswith('copy') or name.endswith('copy'):
    return 'copies'
  if 'broadcast' in name:
    return 'zero-fills'
  if 'fusion' in name or name.startswith('wrapped_'):
    return 'other fused'
  return 'other'


def newest_trace(directory: str) -> str:
  found = glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True)
  if not found:
    raise FileNotFoundError(f'no *.xplane.pb under {directory}; trace some steps first')
  return max(found, key=os.path.getmtime)


def summarize(directory: str, steps: int) -> dict:
  """{'module', 'devices', 'ms': {kind: ms per step per device}, 'top': [(op, ms), ...],
  'wall_ms': the traced steps' span (first operation's start to last one's end) per step}."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  data = ProfileData.from_file(newest_trace(directory))
  by_module = collections.defaultdict(lambda: collections.defaultdict(float))
  devices, spans = collections.defaultdict(set), collections.defaultdict(list)
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        with warnings.catch_warnings():  # jaxlib's event_stats type lacks a __module__
          warnings.simplefilter('ignore', DeprecationWarning)
          stats = dict(event.stats)
        if 'hlo_module' in stats:
          by_module[stats['hlo_module']][event.name] += event.duration_ns / 1e6
          devices[stats['hlo_module']].add(stats.get('device_ordinal', line.name))
          spans[stats['hlo_module']] += [event.start_ns, event.end_ns]
  if not by_module:
    raise ValueError(f'{directory}: the trace holds no compiled operations')
  module = max(by_module, key=lambda m: sum(t for op, t in by_module[m].items() if kind(op)))
  scale = 1 / (steps * len(devices[module]))
  ms = dict.fromkeys(KINDS, 0.0)
  for op, total in by_module[module].items():
    if kind(op):
      ms[kind(op)] += total * scale
  top = sorted(((op, t * scale) for op, t in by_module[module].items() if kind(op)),
               key=lambda pair: -pair[1])[:12]
  wall = (max(spans[module]) - min(spans[module])) / 1e6 / steps
  return dict(module=module, devices=len(devices[module]), ms=ms, top=top, wall_ms=wall)


def table(names: list[str], summaries: list[dict]) -> str:
  """A markdown table, one column per trace."""
  lines = ['| ms per step per device | ' + ' | '.join(names) + ' |',
           '| --- |' + ' --- |' * len(names)]
  for k in KINDS:
    lines.append(f'| {k} | ' + ' | '.join(f"{s['ms'][k]:.1f}" for s in summaries) + ' |')
  lines.append('| total | ' + ' | '.join(f"{sum(s['ms'].values()):.1f}" for s in summaries)
               + ' |')
  lines.append('| wall per step | ' + ' | '.join(f"{s['wall_ms']:.1f}" for s in summaries) + ' |')
  return '\n'.join(lines)


_TRACED_STEPS = flags.DEFINE_integer('traced_steps', 3, 'Steps each trace holds.')


def main(argv):
  if len(argv) < 2:
    sys.exit('usage: python benchmarks/op_profile.py [--traced_steps=N] TRACE_DIR [TRACE_DIR ...]')
  try:
    summaries = [summarize(d, _TRACED_STEPS.value) for d in argv[1:]]
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f'error: {e}')
  for d, s in zip(argv[1:], summaries):
    print(f"{d}: module {s['module']} on {s['devices']} device(s); busiest operations (ms): "
          + ', '.join(f'{op} {t:.1f}' for op, t in s['top']))
  print(table([os.path.basename(os.path.normpath(d)) for d in argv[1:]], summaries))


if __name__ == '__main__':
  app.run(main)

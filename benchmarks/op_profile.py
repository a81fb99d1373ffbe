"""Where a compiled step's time goes, per kind of operation, from jax.profiler traces (CPU, GPU).

  python benchmarks/op_profile.py RUN_A/plugins/profile RUN_B/tensorboard/plugins/profile

Reads each directory's newest `*.xplane.pb`, keeps the events of its busiest compiled module (the
train step; a trace also holds the data pipeline's and the metrics' small programs) and sums
their time by kind: matrix products, collectives, copies, zero-fills (broadcasts), the layer
scan's stacking writes (dynamic-update-slice) and reads (dynamic-slice), the other fused
elementwise work. Containers (a `while` loop's own event spans its body's events) are left out
of the sums. Figures are milliseconds per step per device, over the module's whole executions
in the trace (--traced_steps where a trace does not tell executions apart); `a step's span` is
from its first operation's start to its last one's end on any device. On 8 CPU devices sharing
2 cores an operation's time includes its thread's wait for a core, and a collective's is mostly
waiting for the slowest device, so read each row with the others.
benchmarks/peers.py --profile traces both trainers this way and prints the table.
"""

import collections
import glob
import os
import re
import sys
import warnings

from absl import app, flags

KINDS = ('matrix products', 'attention', 'collectives', 'copies', 'zero-fills',
         'stacking writes', 'slice reads', 'other fused', 'other')
_CONTAINERS = ('while', 'call', 'conditional')
_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute',
                'all-to-all')


def kind(op: str) -> str | None:
  """The kind an HLO operation's event counts under; None for a container."""
  name = re.sub(r'\.\d+$', '', op).replace('_', '-')  # GPU kernels: loop_dynamic_update_slice_fusion
  if name in _CONTAINERS:
    return None
  if name.startswith(_COLLECTIVES):
    return 'collectives'
  # GPU traces name kernels: cuBLAS's nvjet/cutlass/xmma GEMMs, cuDNN's fused attention (sdpa)
  if name.startswith(('dot', 'ynn-fusion', 'onednn', 'convolution', 'nvjet')) or any(
      k in name for k in ('gemm', 'cutlass', 'xmma')):
    return 'matrix products'
  if any(k in name for k in ('sdpa', 'fmha', 'cudnn::fusion')):
    return 'attention'
  if name.startswith(('nccl', 'ncclDevKernel')):
    return 'collectives'
  if 'dynamic-update-slice' in name:
    return 'stacking writes'
  if 'dynamic-slice' in name:
    return 'slice reads'
  if name.startswith('copy') or name.endswith('copy'):
    return 'copies'
  if 'broadcast' in name:
    return 'zero-fills'
  if 'fusion' in name or name.startswith('wrapped-'):
    return 'other fused'
  return 'other'


def newest_trace(directory: str) -> str:
  found = glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True)
  if not found:
    raise FileNotFoundError(f'no *.xplane.pb under {directory}; trace some steps first')
  return max(found, key=os.path.getmtime)


def summarize(directory: str, steps: int) -> dict:
  """{'module', 'devices', 'steps', 'ms': {kind: ms per step per device}, 'top': [(op, ms), ...],
  'wall_ms': a step's span, its first operation's start to its last one's end on any device
  (the whole window over `steps` where the trace does not name executions)}.

  Steps are the module's whole executions in the trace (one cut by the trace's start or end has
  fewer events, and a host that runs ahead has more executions in the window than it traced);
  `steps` where the trace does not tell executions apart."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  data = ProfileData.from_file(newest_trace(directory))
  runs = collections.defaultdict(list)  # (module, execution) -> [(device, op, start, end)]
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        with warnings.catch_warnings():  # jaxlib's event_stats type lacks a __module__
          warnings.simplefilter('ignore', DeprecationWarning)
          stats = dict(event.stats)
        if 'hlo_module' in stats:
          runs[stats['hlo_module'], stats.get('run_id')].append(
              (stats.get('device_ordinal', line.name), event.name, event.start_ns, event.end_ns))
  if not runs:
    raise ValueError(f'{directory}: the trace holds no compiled operations')
  busy = collections.Counter()
  for (module, _), events in runs.items():
    busy[module] += sum(end - start for _, op, start, end in events if kind(op))
  module = max(busy, key=busy.get)
  mine = {run: events for (m, run), events in runs.items() if m == module}
  named = list(mine) != [None]
  if named:  # whole executions only (of all devices, or of one each), counted in device-steps
    mine.pop(None, None)
    whole = max(len(events) for events in mine.values())
    kept = [events for events in mine.values() if len(events) == whole]
  else:
    kept = [mine[None]]
  devices = {event[0] for events in kept for event in events}
  if named:
    steps = sum(len({event[0] for event in events}) for events in kept) / len(devices)
  ms, by_op = dict.fromkeys(KINDS, 0.0), collections.Counter()
  for events in kept:
    for _, op, start, end in events:
      if kind(op):
        by_op[op] += (end - start) / 1e6 / (steps * len(devices))
  for op, t in by_op.items():
    ms[kind(op)] += t
  spans = [(max(e[3] for e in events) - min(e[2] for e in events)) / 1e6 for events in kept]
  wall = sum(spans) / len(spans) if named else spans[0] / steps
  return dict(module=module, devices=len(devices), steps=steps, ms=ms,
              top=by_op.most_common(12), wall_ms=wall)


def table(names: list[str], summaries: list[dict]) -> str:
  """A markdown table, one column per trace."""
  lines = ['| ms per step per device | ' + ' | '.join(names) + ' |',
           '| --- |' + ' --- |' * len(names)]
  for k in KINDS:
    lines.append(f'| {k} | ' + ' | '.join(f"{s['ms'][k]:.1f}" for s in summaries) + ' |')
  lines.append('| total | ' + ' | '.join(f"{sum(s['ms'].values()):.1f}" for s in summaries)
               + ' |')
  lines.append("| a step's span | " + ' | '.join(f"{s['wall_ms']:.1f}" for s in summaries) + ' |')
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
    print(f"{d}: module {s['module']}, {s['steps']:g} steps on {s['devices']} device(s); busiest "
          "operations (ms): "
          + ', '.join(f'{op} {t:.1f}' for op, t in s['top']))
  print(table([os.path.basename(os.path.normpath(d)) for d in argv[1:]], summaries))


if __name__ == '__main__':
  app.run(main)

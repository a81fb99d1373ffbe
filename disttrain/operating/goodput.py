"""Goodput of a run across all its attempts: disttrain goodput RUN_DIR [--json=FILE].

Reads DIR/events.jsonl (disttrain/operating/events.py) and reports how the wall time from the first
attempt's start to the last one's end was spent: productive training (steps that count toward
the final model), start-up and compilation, checkpoint blocking, data waits, evals, steps lost
to restarts (trained after the last committed checkpoint, then trained again; per tier, fast
or persistent, that the next attempt resumed from), idle time
between attempts (backoff, the next process starting) and the rest; and the stragglers the
runs named (events' `straggler`, operating/stragglers.py). An attempt that ended
normally or with an error reports its own time breakdown; one that was killed reports none, so
its steps are costed at the run's mean step time and the rest of its time is `killed, other`
(up to the next attempt's start when no supervisor's exit event says when it died).
"""

import dataclasses
import json

from absl import flags

from disttrain import commandline
from disttrain.errors import DataError, DisttrainError, one_line_errors
from disttrain.operating import events as events_lib
from disttrain.storage import urls

_JSON = flags.DEFINE_string('json', '', 'Also write the report as JSON here.')

TIERS = {'local': 'fast', 'persistent': 'persistent'}  # events' `tier` -> the report's word
CATEGORIES = ('productive', 'startup_and_compile', 'checkpoint', 'data', 'eval', 'lost_steps',
              'idle_between_attempts', 'killed_other', 'other')


@dataclasses.dataclass
class Attempt:
  number: int
  started: float  # when train() began (events' start)
  ended: float | None = None  # its end event, else the supervisor's exit event
  first_step: int = 0  # the step it resumed from
  last_step: int | None = None  # the step it reached (end event), None if killed
  lost_steps: int = 0  # steps it trained past its last checkpoint, trained again by the next
  resumed_from: str = ''  # the tier its first step came from: 'persistent', 'local' (fast) or ''
  exit: str = ''  # how it ended
  time: dict | None = None  # its phase breakdown (end event), None if killed
  trained: bool | None = None  # reached its first step (a `training` event; None: a log without)


def attempts(workdir: str, log: list[dict] | None = None) -> list[Attempt]:
  """The run's attempts in order, from its event log (`log`: already read)."""
  out: list[Attempt] = []
  log = events_lib.read(workdir) if log is None else log
  marked = False  # from the first `training` event on; attempts before it: an older disttrain
  for e in log:
    kind = e.get('event')
    if kind == 'start':
      if out and out[-1].ended is None:  # killed with no supervisor to say when: till now
        out[-1].ended, out[-1].exit = e['time'], 'killed (no end or exit event)'
      out.append(Attempt(number=e['attempt'], started=e['time'], trained=False if marked else None))
    elif not out:
      continue
    elif kind == 'training':
      out[-1].trained, marked = True, True
    elif kind == 'restore':
      out[-1].first_step = e['step']
      out[-1].resumed_from = e.get('tier') or ''
      # The steps past the checkpoint are the last attempt's that trained (one that died in
      # set-up trained none).
      before = [a for a in out[:-1] if a.trained is not False]
      if e.get('trained_through') is not None and before:
        before[-1].lost_steps = max(e['trained_through'] - e['step'], 0)
        before[-1].last_step = before[-1].last_step or e['trained_through']
    elif kind == 'end':
      out[-1].ended, out[-1].time = e['time'], e.get('breakdown')
      out[-1].last_step = e.get('step', out[-1].last_step)
      out[-1].exit = e.get('error') or e.get('stopped_by') or 'done'
    elif kind == 'exit' and e.get('attempt') == out[-1].number:
      out[-1].ended = out[-1].ended or e['time']
      out[-1].exit = out[-1].exit or e.get('reason', '')
  return out


def report(workdir: str) -> dict:
  """{'wall_seconds', 'seconds': {category: s}, 'fractions', 'attempts': [...]}."""
  log = events_lib.read(workdir)  # once: on a bucket each read is a download
  runs = attempts(workdir, log)
  if not runs:
    raise DataError(f'{workdir}/{events_lib.FILE} has no start event; pass the workdir of a run '
                    'started by disttrain (it writes the event log)')
  seconds = dict.fromkeys(CATEGORIES, 0.0)
  timed = [a for a in runs if a.time]
  step_seconds = sum(a.time['step']['seconds'] for a in timed)
  steps_timed = sum(max((a.last_step or a.first_step) - a.first_step, 0) for a in timed)
  per_step = step_seconds / steps_timed if steps_timed else 0.0
  for i, a in enumerate(runs):
    if i + 1 < len(runs) and a.ended is not None:
      seconds['idle_between_attempts'] += max(runs[i + 1].started - a.ended, 0.0)
    lost = a.lost_steps * per_step
    if a.time:
      t = {k: v['seconds'] for k, v in a.time.items() if isinstance(v, dict)}
      # GRPO's sampling makes the batches it learns from: productive, like the step.
      made = t['step'] + t.get('sample', 0.0) + t.get('records', 0.0)
      lost = min(lost, made)  # priced at the mean step: at most what its own steps took
      seconds['lost_steps'] += lost
      seconds['productive'] += made - lost
      seconds['startup_and_compile'] += t['setup'] + t['compile']
      for name in ('checkpoint', 'data', 'eval'):
        seconds[name] += t[name]
      seconds['other'] += t.get('other', 0.0) + t.get('profile', 0.0)
    elif a.ended is not None:
      # None kept when the next resumed from before this one's start (a damaged checkpoint),
      # nor by one that died in set-up; the next that trained says how far this one got.
      after = [b for b in runs[i + 1:] if b.trained is not False]
      kept = max(after[0].first_step - a.first_step, 0) * per_step \
          if after and a.trained is not False else 0.0
      span = max(a.ended - a.started, 0.0)
      if kept + lost > span:  # priced at the timed attempts' mean step (a resume's few slow
        # steps): never more than the attempt lasted (productive time was 17 times the wall)
        kept, lost = kept * span / (kept + lost), lost * span / (kept + lost)
      seconds['lost_steps'] += lost
      seconds['productive'] += kept
      seconds['killed_other'] += span - kept - lost
    else:
      seconds['lost_steps'] += lost
  last = runs[-1]
  wall = (last.ended if last.ended is not None else last.started) - runs[0].started
  stragglers = [{k: e.get(k, 'stalled' if k == 'cause' else None)  # logs before causes: stalls
                 for k in ('attempt', 'process', 'host', 'step', 'cause', 'stalled_fraction',
                           'data_fraction', 'others_max', 'seconds')}
                for e in log if e.get('event') == 'straggler']
  by_tier = {}  # steps lost per tier: those past the checkpoint the next attempt resumed from
  for a, b in zip(runs, runs[1:]):
    if a.lost_steps:
      tier = b.resumed_from or 'persistent'
      by_tier[tier] = by_tier.get(tier, 0) + a.lost_steps
  return {'wall_seconds': round(wall, 3), 'stragglers': stragglers, 'lost_steps_by_tier': by_tier,
          'seconds': {k: round(v, 3) for k, v in seconds.items()},
          'fractions': {k: round(v / wall, 4) if wall > 0 else 0.0 for k, v in seconds.items()},
          'mean_step_seconds': round(per_step, 6),
          'attempts': [dataclasses.asdict(a) for a in runs]}  # time: its breakdown, or None


def table(result: dict) -> str:
  lines = [f'{"attempt":>7} {"from step":>9} {"tier":>10} {"to step":>7} {"lost steps":>10} '
           f'{"seconds":>8}  ended']
  for a in result['attempts']:
    took = f'{a["ended"] - a["started"]:.1f}' if a['ended'] is not None else '?'
    tier = TIERS.get(a['resumed_from'], '-')
    reached = '?' if a['last_step'] is None else a['last_step']
    lines.append(f'{a["number"]:>7} {a["first_step"]:>9} {tier:>10} {reached:>7} '
                 f'{a["lost_steps"]:>10} {took:>8}  {a["exit"]}')
  if result['lost_steps_by_tier']:
    lines.append('lost steps by the tier resumed from: ' + ', '.join(
        f'{TIERS[k]} {v}' for k, v in sorted(result['lost_steps_by_tier'].items())))
  lines.append(f'wall {result["wall_seconds"]:.1f}s, goodput '
               f'{result["fractions"]["productive"]:.1%}:')
  for name in CATEGORIES:
    lines.append(f'  {name.replace("_", " "):<24} {result["seconds"][name]:>9.1f}s '
                 f'{result["fractions"][name]:>7.1%}')
  for s in result['stragglers']:  # operating/stragglers.py
    what = 'stalled' if s['cause'] == 'stalled' else 'waited for its data'
    fraction = s.get(f'{s["cause"]}_fraction') or 0
    lines.append(f'straggler: attempt {s["attempt"]} process {s["process"]} ({s["host"]}) '
                 f'{what} {fraction:.0%} of {s["seconds"]:.1f}s by step {s["step"]} (others at '
                 f'most {s["others_max"]:.0%})')
  return '\n'.join(lines)


@one_line_errors
def main(argv):
  if len(argv) != 2:
    raise DataError('pass one run directory: disttrain goodput RUN_DIR')
  run_dir = urls.resolve(argv[1])
  path = urls.join(run_dir, events_lib.FILE)
  try:
    result = report(run_dir)
  except (KeyError, TypeError) as e:  # an event without a field every event of ours has
    raise DataError(f'{path} holds an event that is not disttrain\'s ({type(e).__name__}: {e}); '
                    'pass the run directory the events are from') from None
  except DisttrainError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (a directory, not UTF-8, credentials)
    raise urls.unreadable(path, e) from None
  print(table(result))
  if _JSON.value:
    try:
      with open(_JSON.value, 'w', encoding='utf-8') as f:
        json.dump(result, f, indent=2)
    except OSError as e:
      raise DataError(f'--json={_JSON.value!r} cannot be written ({e.strerror}); pass a path in '
                      'an existing directory') from None


if __name__ == '__main__':
  commandline.run(main)

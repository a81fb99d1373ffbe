"""The straggler rule of operating/stragglers.py on a job emulated in one process: two
processes' monitors share a key-value store, one process's heartbeat reports stalls."""

import itertools

from disttrain.operating import stragglers


class _Store:
  """jax.distributed's key-value client, in memory."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value):
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

  def key_value_delete(self, key):
    del self.values[key]


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _job(monkeypatch, stalls_per_record: list[tuple[float, float]], seconds_per_record=0.5,
         data_per_record: list[tuple[float, float]] | None = None):
  """Runs two monitors over the records (stalled and data-waiting seconds of processes 0 and 1
  in each); returns process 0's events and console lines."""
  clock, store, said, emitted = _Clock(), _Store(), [], []
  monkeypatch.setattr(stragglers.time, 'monotonic', clock)
  monkeypatch.setattr(stragglers.Heartbeat, '__init__', lambda self, tick=0: setattr(
      self, 'stalled', 0.0))
  monkeypatch.setattr(stragglers.Heartbeat, 'close', lambda self: None)
  monitors = [stragglers.Monitor(store, p, 2, said.append,
                                 lambda event, **f: emitted.append((event, f))) for p in (0, 1)]
  data_per_record = data_per_record or [(0.0, 0.0)] * len(stalls_per_record)
  waited = [0.0, 0.0]
  for step, stalls, data in zip(itertools.count(5, 5), stalls_per_record, data_per_record):
    clock.now += seconds_per_record
    for p in (1, 0):  # process 0 notes last
      monitors[p].heartbeat.stalled += stalls[p]
      waited[p] += data[p]
      monitors[p].note(step, waited[p])
  return emitted, said


def test_a_process_stalled_a_third_of_the_time_is_named_once(monkeypatch):
  pattern = [(0.0, 0.4), (0.0, 0.0)] * 10  # process 1 stopped 0.4 s of every 1 s
  emitted, said = _job(monkeypatch, pattern)
  assert [(e, f['process'], f['cause']) for e, f in emitted] == [('straggler', 1, 'stalled')]
  assert 0.3 <= emitted[0][1]['stalled_fraction'] <= 0.5 and emitted[0][1]['others_max'] == 0
  assert len(said) == 1 and said[0].startswith('straggler: process 1 (')


def test_no_alarm_for_small_or_shared_stalls(monkeypatch):
  assert _job(monkeypatch, [(0.02, 0.05)] * 30)[0] == []  # small: under 20 %
  assert _job(monkeypatch, [(0.2, 0.25)] * 30)[0] == []  # both stall alike: the host, not one


def test_named_again_only_after_it_recovered(monkeypatch):
  stalled, healthy = [(0.0, 0.4)] * 12, [(0.0, 0.0)] * 12
  emitted, _ = _job(monkeypatch, stalled + healthy + stalled)
  assert [f['process'] for _, f in emitted] == [1, 1]


def test_a_process_waiting_for_its_data_is_named_by_that_cause(monkeypatch):
  """Slow while running: process 1's input keeps it waiting 0.3 s of every 0.5 s record while
  process 0 waits for it inside the step (no data wait, no stall on either): named once, by
  'data'; when both wait alike (a slow shared store) nobody is."""
  quiet = [(0.0, 0.0)] * 20
  emitted, said = _job(monkeypatch, quiet, data_per_record=[(0.0, 0.3)] * 20)
  assert [(f['process'], f['cause']) for _, f in emitted] == [(1, 'data')]
  assert 0.5 <= emitted[0][1]['data_fraction'] <= 0.7 and 'stalled_fraction' not in emitted[0][1]
  assert 'waited for its data 60% of the last' in said[0], said
  assert _job(monkeypatch, quiet, data_per_record=[(0.3, 0.3)] * 20)[0] == []


def test_a_stall_inside_a_wait_for_data_is_named_once(monkeypatch):
  """A process stopped while it waits for its batch: both counts grow by the stop; named once,
  stalled."""
  emitted, _ = _job(monkeypatch, [(0.0, 0.3)] * 20, data_per_record=[(0.0, 0.3)] * 20)
  assert [(f['process'], f['cause']) for _, f in emitted] == [(1, 'stalled')]

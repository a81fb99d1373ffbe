"""Long multi-device runs on CPU and the real-data accuracy bar."""

import pytest

import disttrain
from tests.helpers import devices, make_config


@pytest.mark.slow
def test_hundreds_of_steps_on_eight_cpu_devices_do_not_deadlock(tmp_path):
  # Queueing many 8-device steps on 2 cores used to abort XLA:CPU's all-reduce after a 40 s
  # rendezvous timeout; the loop bounds the steps in flight. log_every_steps > steps means the
  # host never fetches metrics during the run, which is the case that used to hang.
  cfg = make_config(mesh__data=8, num_train_steps=520, log_every_steps=10_000,
                    model__hidden=32, global_batch_size=64)
  result = disttrain.train(cfg, str(tmp_path), devices=devices(8))
  assert result.trace_count == 1
  assert int(result.state.step) == 520
  assert result.records[-1]['split'] == 'eval' and result.records[-1]['accuracy'] > 0.8


def _mnist_accuracy(mnist_dir, n_devices, workdir, **overrides) -> float:
  # First 8,000 images train, last 2,000 eval, pixels in [0, 1], batch 128, 5 epochs (312 steps).
  cfg = make_config(mesh__data=n_devices, data__name='mnist', data__dir=mnist_dir,
                    global_batch_size=128, num_train_steps=312, log_every_steps=100, **overrides)
  result = disttrain.train(cfg, str(workdir), devices=devices(n_devices))
  final = result.records[-1]
  assert final['split'] == 'eval' and final['num_examples'] == 2000
  return final['accuracy']


@pytest.mark.slow
def test_mnist_mlp_reaches_accuracy_on_eight_devices(mnist_dir, tmp_path):
  # Reference: a hand-written Flax loop of the same model, split and schedule reaches
  # 0.9645-0.9665 over seeds 0-2 on this machine; the bar is 0.955. 8 devices against 1 step by
  # step: tests/test_seed_configs.py (every seed config, the first 30 steps' losses); a second,
  # 1-device run of these 312 steps here cost 22 s of the suite.
  acc8 = _mnist_accuracy(mnist_dir, 8, tmp_path / 'eight')
  assert acc8 >= 0.955, acc8

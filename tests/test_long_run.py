"""Long multi-device runs on CPU."""

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


# The real-data accuracy bar (MNIST, 8 devices, >= 0.955): tests/test_seed_configs.py::test_nnx_mlp
# trains the same 784-512-10 MLP, split and schedule (the Linen form reached 0.9645-0.9665 by the
# hand-written reference; the NNX one 0.968), and every seed config checks 8 devices against 1.

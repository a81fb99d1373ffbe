"""disttrain's XLA flags on NVIDIA GPUs (disttrain/parallel/xla_flags.py): the defaults on a GPU,
nothing elsewhere or when switched off, the user's own value always kept, and run.json says what
was added."""

import os

import pytest

import disttrain
from disttrain.parallel import xla_flags
from disttrain.training import setup as run_lib
from tests import helpers

# What jaxlib 0.12's XLA accepts (the names are in its libjax_common.so, the values parse).
DEFAULTS = ['--xla_gpu_enable_latency_hiding_scheduler=true',
            '--xla_gpu_enable_while_loop_double_buffering=true',
            '--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL']


def test_the_defaults_on_a_gpu_nothing_elsewhere_and_the_switch_turns_them_off():
  assert xla_flags.merge('', gpu=True) == (' '.join(DEFAULTS), DEFAULTS)
  user = '--xla_dump_to=/tmp/x'
  assert xla_flags.merge(user, gpu=True) == (' '.join([user, *DEFAULTS]), DEFAULTS)
  assert xla_flags.merge(user, gpu=False) == (user, [])
  assert xla_flags.merge(user, gpu=True, enabled=False) == (user, [])


@pytest.mark.parametrize('user', [
    '--xla_gpu_enable_latency_hiding_scheduler=false',
    '--xla_gpu_enable_latency_hiding_scheduler',  # a bare bool flag is true
    '--noxla_gpu_enable_latency_hiding_scheduler',
])
def test_a_flag_the_user_sets_keeps_their_value(user):
  flags, added = xla_flags.merge(f'--xla_dump_to=/tmp/x  {user} --xla_gpu_enable_command_buffer=',
                                 gpu=True)
  assert added == ['--xla_gpu_enable_while_loop_double_buffering=true']
  assert flags == f'--xla_dump_to=/tmp/x  {user} --xla_gpu_enable_command_buffer= {added[0]}'
  # A longer flag that starts with a default's name is a different flag.
  _, added = xla_flags.merge('--xla_gpu_enable_latency_hiding_scheduler_rerun=1', gpu=True)
  assert added == DEFAULTS


def test_gpu_is_a_cuda_plugin_and_jax_platforms_naming_it_if_set():
  cuda = lambda name: name == 'jax-cuda13-plugin'
  assert xla_flags.on_gpu(None, installed=cuda) and xla_flags.on_gpu('', installed=cuda)
  assert xla_flags.on_gpu('cuda,cpu', installed=cuda) and xla_flags.on_gpu('gpu', installed=cuda)
  assert not xla_flags.on_gpu('cpu', installed=cuda)
  assert not xla_flags.on_gpu(None, installed=lambda name: False)  # a CPU-only jaxlib
  assert not xla_flags.on_gpu(None)  # this machine: no CUDA plugin installed


def test_run_json_records_the_flags_and_what_disttrain_added(monkeypatch):
  monkeypatch.setattr(xla_flags, '_added', [])
  monkeypatch.setenv('XLA_FLAGS', '--xla_backend_optimization_level=0')
  run = disttrain.setup(helpers.make_config(mesh__data=1), devices=helpers.devices(1))
  assert run_lib.run_info(run)['xla_flags'] == {
      'XLA_FLAGS': '--xla_backend_optimization_level=0', 'added_by_disttrain': []}
  xla_flags.apply(gpu=True)  # as the launcher does on a GPU, before the backend starts
  assert os.environ['XLA_FLAGS'] == ' '.join(['--xla_backend_optimization_level=0', *DEFAULTS])
  assert run_lib.run_info(run)['xla_flags'] == {'XLA_FLAGS': os.environ['XLA_FLAGS'],
                                                'added_by_disttrain': DEFAULTS}

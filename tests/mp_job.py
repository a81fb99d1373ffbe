"""What every local_cluster worker script of the tests starts with (tests/mp_*.py)."""

import argparse


def join() -> argparse.Namespace:
  """Parses the flags local_cluster gives a program (and --out), gives this process its fake CPU
  devices and joins the job; returns the flags."""
  parser = argparse.ArgumentParser()
  for name in ('coordinator_address', 'out'):
    parser.add_argument(f'--{name}', required=True)
  for name in ('fake_devices', 'num_processes', 'process_id'):
    parser.add_argument(f'--{name}', type=int, required=True)
  args = parser.parse_args()
  import jax  # pylint: disable=g-import-not-at-top  (configured before its backend starts)
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', args.fake_devices)
  from disttrain.parallel import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                         init_timeout=120)
  return args

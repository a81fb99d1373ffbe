"""A program of the user's on every process of a job: it joins the job itself and calls
disttrain.train twice (no launcher), with tests/configs/ops.py's data and its FAIL_AT /
FAIL_PROCESS and SLOW_READS hooks applied to the second run only; with DIVERGE_LR, the second
run's learning rate, which makes its loss NaN on every process, and the program catches that
NonFiniteError and goes on.

  python launch/local_cluster.py --program=tests/mp_train_api.py --num_processes=2 \
      --devices_per_process=4 -- --out=DIR

The first run ends normally: a failure in the second must still reach every process (a watch per
train() call, disttrain/parallel/failures.py). Nothing here catches any other failure: the failing
process ends as any uncaught exception ends a Python program.
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import mp_job  # pylint: disable=g-import-not-at-top,wrong-import-position

RUN = {'model.hidden': 64, 'global_batch_size': 64, 'eval_batch_size': 64, 'log_every_steps': 1,
       'checkpoint_every_steps': 0, 'eval_every_steps': 0}


def main():
  args = mp_job.join()
  from disttrain import config as config_lib  # pylint: disable=g-import-not-at-top
  import disttrain  # pylint: disable=g-import-not-at-top
  from tests import helpers  # pylint: disable=g-import-not-at-top
  ops = runpy.run_path(os.path.join(os.path.dirname(__file__), 'configs', 'ops.py'))
  second_only = {k: os.environ.pop(k) for k in ('FAIL_AT', 'SLOW_READS') if k in os.environ}
  diverge = os.environ.get('DIVERGE_LR')  # the second run's learning rate: every process's NaN
  for name, steps in (('first', 3), ('second', 1000)):
    if name == 'second':
      os.environ.update(second_only)  # ops.Reads reads them when it is made
    overrides = {**RUN, 'num_train_steps': steps}
    if name == 'second' and diverge:
      overrides['learning_rate'] = float(diverge)
    cfg = config_lib.from_config_dict(helpers.override(ops['get_config'](), overrides))
    try:
      result = disttrain.train(cfg, os.path.join(args.out, name), **ops['get_data'](cfg))
    except disttrain.NonFiniteError as e:  # the program's own answer to a diverged run
      print(f'{name} run raised NonFiniteError: {e}', flush=True)
      continue
    print(f'{name} run ended at step {result.step}', flush=True)


if __name__ == '__main__':
  main()

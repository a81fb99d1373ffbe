"""A stand-in training job for tests/test_supervise.py: attempt k does what PLAN[k-1] says.

PLAN is JSON: [[status, committed step or null], ...]. The attempt appends its number to
WORKDIR/attempts.txt, makes WORKDIR/checkpoints/<step> (a committed checkpoint, as orbax leaves
it) and exits with the status, or kills itself with signal -status when it is negative.
"""

import json
import os
import sys

workdir = os.path.expanduser(next(a.split('=', 1)[1] for a in sys.argv
                                   if a.startswith('--workdir=')))  # as train reads it
attempt = int(os.environ['DISTTRAIN_ATTEMPT'])
status, step = json.loads(os.environ['PLAN'])[attempt - 1]
os.makedirs(workdir, exist_ok=True)
with open(os.path.join(workdir, 'attempts.txt'), 'a', encoding='utf-8') as f:
  f.write(f'{attempt}\n')
if step is not None:
  os.makedirs(os.path.join(workdir, 'checkpoints', str(step)), exist_ok=True)
if status < 0:
  os.kill(os.getpid(), -status)
sys.exit(status)

"""python launch/supervise.py [flags] -- COMMAND: rerun a job from its last checkpoint.

The restart supervisor is disttrain/launch/supervise.py, also run as `disttrain supervise`; this
file runs it from a checkout, installed or not.
"""

import os
import runpy
import sys

if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  runpy.run_module('disttrain.launch.supervise', run_name='__main__', alter_sys=True)

"""python launch/local_cluster.py [flags] -- TRAIN FLAGS: one jax.distributed job on this host.

P processes x D fake CPU devices (gloo) is disttrain/launch/cluster.py, also run as
`disttrain cluster`; this file runs it from a checkout, installed or not.
"""

import os
import runpy
import sys

if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  runpy.run_module('disttrain.launch.cluster', run_name='__main__', alter_sys=True)

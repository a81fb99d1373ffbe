"""python launch/train.py --config=launch/configs/mnist_mlp.py --workdir=DIR: train a config.

The absl launcher (flags, --config.<field>=... overrides, config-file hooks, --check) is
disttrain/launch/train.py, also run as `disttrain train`; this file runs it from a checkout,
installed or not.
"""

import os
import runpy
import sys

if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  runpy.run_module('disttrain.launch.train', run_name='__main__', alter_sys=True)

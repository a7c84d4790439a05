"""horovodrun for the tests, less its Gloo build check: ``python tests/support/horovodrun.py
--gloo -np 2 ...`` runs Horovod's own command line.

With ``--gloo`` horovodrun first forks a process that imports TensorFlow to ask whether Horovod
was built with Gloo: 8 s of every job here, before any rank starts. scripts/install.sh has asked
once (``hvd.gloo_built()``), and a rank whose Horovod lacks Gloo still fails at ``hvd.init``.
"""

import sys

from horovod.runner import launch

if __name__ == "__main__":  # horovodrun's helpers start processes: this module is their main
    launch.gloo_built = lambda verbose=False: True  # the name run_controller looks up
    sys.exit(launch.run_commandline())

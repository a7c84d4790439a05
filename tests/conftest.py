"""The suite's layout, one folder per way of running:

- ``unit/``: numpy-only code, one process, no TensorFlow;
- ``keras/``: TensorFlow and Keras in one process;
- ``multirank/``: jobs of several ranks under horovodrun (``support.run_ranks``: hard
  timeout, every rank killed after it);
- ``tools/``: the command line, the emulation launcher and the benchmarks;
- ``rank_scripts/``: the programs the multi-rank tests launch (not collected);
- ``support/``: the shared helpers (``from support import run_ranks``).
"""

collect_ignore = ["rank_scripts"]

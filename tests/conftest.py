"""The suite's layout, one folder per way of running:

- ``unit/``: numpy-only code, one process, no TensorFlow;
- ``keras/``: TensorFlow and Keras in one process;
- ``multirank/``: jobs of several ranks under horovodrun (``support.run_ranks``: hard
  timeout, every rank killed after it);
- ``tools/``: the command line, the emulation launcher and the benchmarks;
- ``examples/``: the scripts in ``examples/`` run as users run them (smoke tests);
- ``torch_edge/``: ``hvd_balance.torch`` (the torch stack only; jobs under torchrun through
  ``support.torchrun``); not named ``torch/``, which would shadow the package;
- ``keras_torch/``: ``hvd_balance.keras`` on Keras 3's torch backend (the torch stack; torchrun);
- ``cluster/``: jobs on ssh hosts in network namespaces (root);
- ``rank_scripts/``: the programs the multi-rank tests launch (not collected);
- ``support/``: the shared helpers (``from support import run_ranks``).
"""

import pytest

collect_ignore = ["rank_scripts"]
TORCH_FOLDERS = ("tests/torch_edge/", "tests/keras_torch/")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(folder in str(item.fspath).replace("\\", "/") for folder in TORCH_FOLDERS):
            item.add_marker(pytest.mark.torch)

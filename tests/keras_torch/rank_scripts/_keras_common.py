"""What the Keras-on-torch rank scripts share: the backend, the process group, the result
hand-over and a clean exit (tests/torch_edge/rank_scripts/_common.py's)."""

import os
import sys
from pathlib import Path

os.environ["KERAS_BACKEND"] = "torch"  # before Keras is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch_edge" / "rank_scripts"))

import torch  # noqa: E402
from _common import emit, finish  # noqa: E402,F401 - the torch edge's

import hvd_balance.keras as hvd  # noqa: E402


def init():
    """One thread a rank, the Gloo group; returns (rank, world size)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hvd.init()
    return hvd.rank(), hvd.size()

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


def exactness_job(samples: int, syncbn: bool, rank: int):
    """The exactness jobs' inputs: ``samples`` rows of 6 float32 features with a linear rule,
    and ``build(norm)``, a small MLP (``norm``'s layer after the first with ``syncbn``) seeded
    differently on each rank (the broadcast makes them equal): ``(x, y, build)``."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 6)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64")

    def build(norm):
        keras.utils.set_random_seed(rank + 1)
        layers = [keras.Input((6,)), keras.layers.Dense(8)] + ([norm()] if syncbn else [])
        return keras.Sequential(layers + [keras.layers.ReLU(), keras.layers.Dense(2)])
    return x, y, build

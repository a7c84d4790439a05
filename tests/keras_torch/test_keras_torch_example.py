"""examples/keras_torch.py, Horovod's Keras example shape on Keras's torch backend, runs as it
stands on 2 ranks under torchrun."""

import json
import math

from support.torchrun import run_torchrun


def test_keras_torch_example_trains_and_every_rank_ends_with_the_same_weights(tmp_path):
    run = run_torchrun("examples/keras_torch.py", nproc=2, timeout=150,
                       args=["--epochs", "2", "--samples", "1024", "--json", tmp_path / "out.json"])
    assert run.returncode == 0, run.stdout[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["same_weights"] is True
    assert sum(out["local_batches"]) == out["global_batch"] == 128, out["local_batches"]
    loss = out["history"]["loss"]
    assert all(math.isfinite(v) for v in loss) and loss[-1] < 0.8 * loss[0], loss
    assert out["history"]["accuracy"][-1] > 0.5, out["history"]
    assert "local batch" in run.stdout  # the plan table rank 0 prints

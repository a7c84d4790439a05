"""examples/keras_mnist_horovod.py, Horovod's Keras example on ``hvd_balance.keras``, runs as
it stands on 2 ranks: as Horovod wrote it (``--no-balance``) and balanced, on every stack."""

import json
import math

import pytest

from support import run_ranks

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI

EXAMPLE = "examples/keras_mnist_horovod.py"


@pytest.mark.timeout(300)
# --no-balance (plain Horovod's run of the example): a second run of it, in the long runs
@pytest.mark.parametrize("mode", [pytest.param("--no-balance", marks=pytest.mark.slow),
                                  "balanced"])
def test_keras_mnist_example_trains_and_every_rank_ends_with_the_same_weights(mode, tmp_path):
    args = ["--epochs", "2", "--warmup-epochs", "2", "--batch-size", "64",
            "--checkpoint-dir", tmp_path / "ck", "--json", tmp_path / "out.json"]
    run = run_ranks(EXAMPLE, np=2, args=args + ([mode] if mode.startswith("--") else []),
                    timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["same_weights"] is True
    assert sum(out["local_batches"]) == out["global_batch"] == 128, out["local_batches"]
    loss = out["history"]["loss"]
    assert all(math.isfinite(v) for v in loss) and loss[-1] < 0.8 * loss[0], loss
    assert out["history"]["accuracy"][-1] > 0.5, out["history"]
    # the warm-up ramps the learning rate from 0.001 to 0.001 * size over two epochs
    lrs = out["history"]["lr"]
    assert lrs[0] == pytest.approx(0.0015, rel=1e-5) and lrs[1] == pytest.approx(0.002, rel=1e-5)
    assert out["checkpoints"] == ["checkpoint-1.keras", "checkpoint-2.keras"]
    assert "finished gradual learning rate warmup" in run.stdout
    if mode == "balanced":
        assert "local batch" in run.stdout  # the plan table rank 0 prints

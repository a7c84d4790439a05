"""A Horovod Keras script runs on ``hvd_balance.keras`` with its import line changed: plain
(Horovod's example as written) and made balanced, on every supported stack."""

import pytest

from support import run_ranks

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["plain", "balanced"])
def test_horovod_keras_example_trains_and_every_rank_ends_with_the_same_weights(mode):
    run = run_ranks("tests/rank_scripts/horovod_keras_example.py", np=2, args=[mode], timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"]
    for r in (0, 1):
        assert results[r]["last_loss"] < 0.7 * results[r]["first_loss"], results[r]
        assert results[r]["last_accuracy"] > 0.6
        # the warm-up ramps the learning rate from 0.001 to 0.001 * size over two epochs
        lrs = results[r]["lr_logged"]
        assert lrs[0] < lrs[1] == pytest.approx(0.002, rel=1e-5) and lrs[-1] == pytest.approx(0.002, rel=1e-5)
    assert results[0]["checkpoints"] == [f"checkpoint-{e}.keras" for e in (1, 2, 3, 4)]
    assert "finished gradual learning rate warmup" in run.stdout

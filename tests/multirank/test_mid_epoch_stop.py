"""A rank that stops in the middle of an epoch (its own callback, TerminateOnNaN on its own NaN)
while its process lives on: every rank leaves fit within a minute, each naming who, where, why."""

import pytest

from support import run_ranks

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI

STOP_BATCH, STEPS = 5, 20  # tests/rank_scripts/mid_epoch_stop.py


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,cause", [("callbacks", "callback"),
                                        pytest.param("balancer", "nan",
                                                     marks=pytest.mark.default_stack),
                                        # the balancer's path plus the out-of-band watchdog
                                        pytest.param("watchdog", "nan",
                                                     marks=pytest.mark.default_stack)])
def test_a_rank_stopping_mid_epoch_stops_every_rank_cleanly_naming_it(kind, cause):
    run = run_ranks("tests/rank_scripts/stop_fit.py", np=2, args=["mid", kind, cause], timeout=150)
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert sorted(results) == [0, 1], run.stdout[-3000:]  # both alive after fit, and said so
    why = "its loss is nan: TerminateOnNaN?" if cause == "nan" else "a callback set model.stop_training"
    for r in (0, 1):
        res = results[r]
        assert res["error"] is None, res
        assert res["epochs_run"] == 1, res  # nobody began epoch 1
        assert {k: res["stop"][k] for k in ("rank", "epoch", "batch", "steps", "why")} == \
            {"rank": 1, "epoch": 0, "batch": STOP_BATCH, "steps": STEPS, "why": why}, res
        said = [line for line in run.rank_lines(r) if line.startswith("hvd_balance: rank 1 stopped")]
        assert said and (f"in the middle of epoch 0, after batch {STOP_BATCH} of {STEPS} ({why}); "
                         "every rank stops with it") in said[0], run.stdout[-3000:]
        assert f"rank {r} lives on after fit" in run.rank_lines(r)
    assert results[1]["batches_run"] == STOP_BATCH + 1
    assert STOP_BATCH + 1 <= results[0]["batches_run"] < STEPS  # left the epoch, at its next step
    assert max(res["fit_returned_at"] for res in results.values()) - results[1]["stopped_at"] < 60

"""A soak run under load: 50 short epochs on 2 emulated ranks of unequal speed (a full core and
half a core), rebalancing every epoch, while per-step throttles come and go. Nothing may
leak or drift: memory stays flat, every epoch runs the same steps on every rank, and every
rank holds the same plan at every step.

Runs in about a minute (44 s measured on a 2-core machine); the peak resident memory at the
start and end of each rank is printed (``pytest -s`` or ``-rP`` shows it).
"""
import inspect

import pytest

import hvd_balance
from support import can_emulate, run_ranks

SCRIPT = "tests/rank_scripts/soak_fit.py"
EPOCHS = 50
# rank 0 pays 10 ms a step in epochs 10-24, then rank 1 in epochs 25-39, then nobody.
THROTTLE = "0:10-24:10,1:25-39:10"
RSS_GROWTH_MB = 50  # allowed growth of resident memory from epoch 5 to the end


@pytest.mark.skipif(not can_emulate(), reason="needs root and a cgroup cpu controller")
@pytest.mark.skipif("rebalance" not in inspect.signature(hvd_balance.LoadBalancer).parameters,
                    reason="waits for LoadBalancer(data, rebalance='epoch')")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fifty_epochs_with_rebalancing_and_changing_throttles_leak_and_drift_nothing():
    run = run_ranks(SCRIPT, np=2, cpu_shares=[1.0, 0.5], args=[EPOCHS], timeout=540,
                    env={"HVD_BALANCE_SOAK_THROTTLE": THROTTLE})
    assert run.returncode == 0, run.stdout[-4000:]
    per_rank = run.results()
    assert sorted(per_rank) == [0, 1]
    a, b = per_rank[0], per_rank[1]
    for r in (a, b):
        print(f"rank {r['rank']}: peak RSS {r['peak_rss_mb'][0]:.0f} MB after epoch 1, "
              f"{r['peak_rss_mb'][-1]:.0f} MB after epoch {EPOCHS}; RSS {r['rss_mb'][5]:.0f} -> "
              f"{r['rss_mb'][-1]:.0f} MB from epoch 6; {r['seconds']:.0f} s of training")
        # No drift: every epoch the same number of steps, and the optimizer saw them all.
        assert r["steps"] == [r["len"]] * EPOCHS and r["len"] == 16
        assert r["iterations"] == EPOCHS * r["len"]
        # No leak: memory is flat once warmed up.
        assert r["rss_mb"][-1] - r["rss_mb"][5] < RSS_GROWTH_MB, r["rss_mb"]
        assert r["peak_rss_mb"][-1] - r["peak_rss_mb"][5] < RSS_GROWTH_MB, r["peak_rss_mb"]
    # Identical plans on every rank at every step of every epoch, and identical decisions.
    assert a["plans"] == b["plans"]
    assert a["history"] == b["history"]
    for epoch_plans in a["plans"]:
        assert all(sum(p) == 128 and min(p) >= 1 for p in epoch_plans)
    # Rebalancing was on: one decision at every epoch end, taken alike on every rank. (Whether
    # the plan changes depends on the machine's noise, see tests/multirank/test_adaptive.py for that.)
    assert [h["epoch"] for h in a["history"]] == list(range(EPOCHS))
    changes = [(h["epoch"], h["next_batch_sizes"]) for h in a["history"] if h["decision"] in ("switched", "reverted")]
    print(f"plan changes (epoch, batches): {changes}")

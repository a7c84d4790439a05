"""The slow-device emulation (``HVD_BALANCE_SLOWDOWN``): a rank's compute is k times slower,
counted as its busy time, while its collectives are not slowed."""

import pytest

from support import run_ranks

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI: Keras 2 hooks Horovod's optimizer

SLOWDOWN = 3.0


@pytest.mark.timeout(300)
# The benchmark's step timer slows the same way on every stack: CI runs it on the default one.
@pytest.mark.parametrize("step", ["library", pytest.param("bench", marks=pytest.mark.default_stack)])
def test_a_slowed_rank_is_k_times_busier_and_its_allreduce_is_not_slowed(step):
    """``library``: Keras's own step; ``bench``: the benchmark's timed step, which applies the
    wait itself (once: the optimizer's is off, or the ratio would be near 2k - 1)."""
    run = run_ranks("tests/rank_scripts/slowdown_fit.py", np=2, args=[f"1,{SLOWDOWN:g}", step],
                    timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = run.results()
    assert sorted(per_rank) == [0, 1]
    fast, slow = per_rank[0], per_rank[1]
    assert (fast["slowdown"], slow["slowdown"]) == (1.0, SLOWDOWN)
    for r in (fast, slow):
        assert r["busy_steps"] >= 20, r
    # equal batches, equal compute: the slowed rank's busy time is about k times the other's
    # (wide bounds: a shared machine's noise)
    ratio = slow["busy_median_s"] / fast["busy_median_s"]
    assert 2.2 < ratio < 4.0, (fast, slow)
    # the fast rank waits for the slow one in the allreduce; the slow one arrives last and its
    # allreduce is a full-speed one, not k times longer
    extra = slow["busy_median_s"] - fast["busy_median_s"]
    assert fast["wait_median_s"] > 0.6 * extra, (fast, slow)
    assert slow["wait_median_s"] < 0.25 * extra, (fast, slow)
    if step == "bench":  # the benchmark's own record agrees
        assert 2.2 < slow["bench_busy_median_s"] / fast["bench_busy_median_s"] < 4.0, (fast, slow)


@pytest.mark.parametrize("value", ["0.5", "x", "nan", "inf", "-2"])
def test_a_bad_slowdown_in_the_environment_is_refused_by_name(value, monkeypatch):
    from hvd_balance.keras import telemetry

    monkeypatch.setenv(telemetry.ENV_SLOWDOWN, value)
    telemetry.slowdown_factor.cache_clear()  # read once per process: read it again here
    try:
        with pytest.raises(ValueError, match=f"HVD_BALANCE_SLOWDOWN='{value}' must be a finite "
                                             "number >= 1"):
            telemetry.slowdown_factor()
    finally:
        telemetry.slowdown_factor.cache_clear()


def test_the_launcher_and_the_library_name_the_same_variable():
    from hvd_balance.keras import telemetry
    from hvd_balance.tools import emulate

    assert emulate.ENV_SLOWDOWN == telemetry.ENV_SLOWDOWN == "HVD_BALANCE_SLOWDOWN"

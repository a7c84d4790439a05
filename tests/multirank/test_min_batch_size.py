"""LoadBalancer(min_batch_size=...) on real ranks: a slow rank that a plan would give a few
samples keeps the floor through the benchmark's plan and the re-plans, and without the floor
rank 0 warns once, naming the unsynchronized BatchNormalization layer and the rank."""

import pytest

from support import run_ranks

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI

SCRIPT = "tests/rank_scripts/min_batch_fit.py"


@pytest.mark.timeout(420)
def test_the_floor_holds_on_a_slow_rank_and_the_warning_names_the_layer():
    run = run_ranks(SCRIPT, np=2, timeout=360)
    assert run.returncode == 0, run.stdout[-3000:]
    res = run.results()
    free, floored = res[0]["free"], res[0]["floored"]
    for r in (0, 1):  # every rank holds the same plans
        assert res[r]["free"]["plan"] == free["plan"] and res[r]["floored"]["plan"] == floored["plan"]
    # Without a floor the slow rank gets a handful of samples, and rank 0 alone warns, once.
    slow = free["plan"]["batch_sizes"][1]
    assert slow < 16 and res[1]["free"]["local_batch"] == slow
    assert len(free["warnings"]) == 1 and res[1]["free"]["warnings"] == []
    text = free["warnings"][0]
    assert f"rank 1: {slow}" in text and "'bn'" in text and "min_batch_size=16" in text
    assert "convert_sync_batchnorm" in text
    # With min_batch_size=16: 16 samples from the first plan on, in every re-plan, no warning.
    assert floored["plan"]["batch_sizes"] == [48, 16] and floored["plan"]["min_batch_sizes"] == [16, 16]
    assert res[1]["floored"]["local_batch"] == 16
    assert floored["history"] and all(b[1] >= 16 for b in floored["history"])
    assert floored["warnings"] == [] and res[1]["floored"]["warnings"] == []
    # Without a benchmark the first plan comes after 3 equal steps, and the warning with it.
    first = res[0]["first_steps"]
    assert first["history"][0][1] < 16, first["history"]
    assert len(first["warnings"]) == 1 and res[1]["first_steps"]["warnings"] == []
    assert f"rank 1: {first['history'][0][1]}" in first["warnings"][0]

"""One window's record, the same on every edge: the step is the ranks' median, the efficiency
counts the ranks that train, the decision fills its fields and nothing else."""
import pytest

from hvd_balance.core.window_record import record_decision, window_record, window_step_s


def test_the_window_step_is_the_median_of_the_counted_steps():
    assert window_step_s([0.10, 0.30, 0.11]) == pytest.approx(0.11)
    assert window_step_s([0.10, None, 0.12]) == pytest.approx(0.11)  # a rank left out
    assert window_step_s([None, None]) is None


def test_a_record_is_in_milliseconds_and_counts_only_the_ranks_that_train():
    r = window_record(2, 0, [64, 0], busy_s=[0.08, 0.5], wait_s=[0.001, None],
                      step_s=[0.081, None], busy_rse=[0.02, 0.3])
    assert (r["epoch"], r["step"], r["batch_sizes"]) == (2, 0, [64, 0])
    assert r["busy_ms"] == pytest.approx([80.0, 500.0]) and r["wait_ms"][1] is None
    assert r["step_ms"] == 81.0 and r["efficiency"] == 1.0  # rank 1's probe step is no step
    assert r["decision"] is r["predicted_ms"] is r["variation"] is r["leave_out"] is None
    assert r["next_batch_sizes"] == [64, 0]


def test_the_first_window_has_no_step_and_a_rank_without_busy_time_no_efficiency():
    r = window_record(0, 3, [32, 32], [0.04, None], [0.0, None], [0.05, None], [0.1, None],
                      first=True)
    assert r["step_ms"] is None and r["efficiency"] is None


def test_a_decision_fills_its_fields_and_the_plan_after_it():
    r = window_record(0, 3, [32, 32], [0.02, 0.06], [0.04, 0.0], [0.06, 0.06], [0.1, 0.1])
    before = dict(r)
    record_decision(r, "switched", 0.041234, 0.05, (48, 16), [1])
    assert (r["decision"], r["predicted_ms"], r["variation"]) == ("switched", 41.23, 0.05)
    assert r["next_batch_sizes"] == [48, 16] and r["batch_sizes"] == [32, 32]
    assert r["leave_out"] == [1]
    changed = {k for k in r if r[k] != before[k]}
    assert changed == {"decision", "predicted_ms", "variation", "next_batch_sizes", "leave_out"}

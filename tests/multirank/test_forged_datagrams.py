"""A stranger on the job's host tries to flood its channels (the stop notes' and the watchdog's)
with forged datagrams while it trains: none reaches a rank, nothing changes, nothing is printed
(hvd_balance.channel)."""

import numpy as np
import pytest

from support import run_ranks
from support.forge import Flood


@pytest.mark.timeout(240)
def test_forged_datagrams_change_nothing_and_print_nothing():
    flood = Flood(size=2)
    flood.start()
    try:
        run = run_ranks("tests/rank_scripts/forged_datagrams_fit.py", np=2, timeout=180,
                        env=flood.env)
    finally:
        stats = flood.stop()
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert sorted(results) == [0, 1], run.stdout[-3000:]
    for r in results.values():
        assert r["error"] is None and (r["epochs"], r["batches"]) == (2, 60), r
    assert results[0]["max_diff"] < 1e-6, results[0]["max_diff"]  # one process, same batches
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Two Unix sockets (one each way) per channel and rank (one peer each). What the stranger
    # got in before they were connected (it runs as the same user here) was discarded unread.
    assert stats["ports"] == [] and len(stats["unix"]) == 8, stats
    assert sum(r["dropped"] for r in results.values()) == stats["sent"], (results, stats)
    assert "FORGED" not in run.stdout and "stopped" not in run.stdout, run.stdout[-3000:]

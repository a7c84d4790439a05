"""core.metric_average: epoch metrics over every rank's samples (ranks simulated)."""

import math

import numpy as np

from hvd_balance.core.metric_average import weighted_average


def over_ranks(per_rank_logs, train, val):
    """Every rank's result, with the sum over ranks done in one process."""
    vectors = []

    def capture(vector):
        vectors.append(vector)
        return vector

    for logs, n, m in zip(per_rank_logs, train, val):
        weighted_average(logs, n, m, capture)
    total = np.sum(vectors, axis=0)
    return [weighted_average(logs, n, m, lambda _: total)
            for logs, n, m in zip(per_rank_logs, train, val)]


def test_each_rank_counts_by_its_samples_and_a_rank_without_samples_adds_nothing():
    """A rank left out (0 samples) whose probe step's loss was inf or NaN changes nothing."""
    logs = [{"loss": 1.0, "val_loss": 3.0}, {"loss": 4.0, "val_loss": 5.0},
            {"loss": math.inf, "val_loss": math.nan}]
    out = over_ranks(logs, train=[30, 10, 0], val=[1, 1, 0])
    for result in out:
        assert result["loss"] == (30 * 1.0 + 10 * 4.0) / 40
        assert result["val_loss"] == 4.0

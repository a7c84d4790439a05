"""SyncBatchNormalization: balanced steps with unequal local batches (one rank holding 1 sample)
equal one process with Keras's BatchNormalization on the global batch; Keras's layer per rank,
Horovod's SyncBatchNormalization and an unweighted backward pass do not."""

import pytest

from support import run_ranks

pytestmark = pytest.mark.stacks  # also run on the other stacks in CI

MODELS = ("dense", "conv")


def _run(batches, variants, timeout):
    sizes = [int(b) for b in batches.split(",")]
    run = run_ranks("tests/rank_scripts/sync_batch_norm_step.py", np=len(sizes),
                    args=[batches, ",".join(variants)], timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = run.results()
    assert sorted(per_rank) == list(range(len(sizes)))
    return per_rank


def _assert_equals_one_process(per_rank):
    for r in per_rank.values():
        for m in MODELS:
            assert r[f"error_sync_{m}"] is None, r[f"error_sync_{m}"]
            assert r[f"moved_sync_{m}"] > 1e-3                   # the steps really trained
            assert r[f"err_trainable_sync_{m}"] < 1e-5, r         # the one-process weights
            assert r[f"err_moving_sync_{m}"] < 1e-5, r            # and moving statistics
    for m in MODELS:  # identical on every rank
        first = per_rank[0][f"moving_sync_{m}"]
        assert all(r[f"moving_sync_{m}"] == first for r in per_rank.values())


@pytest.mark.timeout(600)
def test_three_ranks_equal_one_process_and_the_alternatives_do_not():
    """Three ranks, one of them a single sample: SyncBatchNormalization with the weighted
    gradient equals one process on the global batch; per-rank statistics, Horovod's layer and
    an unweighted gradient do not."""
    per_rank = _run("1,4,11", ["sync", "local", "horovod", "unweighted"], timeout=540)
    _assert_equals_one_process(per_rank)
    for r in per_rank.values():
        for m in MODELS:
            # each rank normalizing with its own samples: a different step
            assert r[f"err_trainable_local_{m}"] > 1e-2, r[f"err_trainable_local_{m}"]
            # the right forward statistics with Horovod's unweighted gradient of the allreduce
            assert r[f"err_trainable_unweighted_{m}"] > 1e-2, r[f"err_trainable_unweighted_{m}"]
            # Horovod's layer: unweighted statistics where it runs (Keras 2); on Keras 3 it
            # cannot even be built (it passes fused=False, which Keras 3 does not know)
            if r[f"error_horovod_{m}"] is None:
                assert max(r[f"err_trainable_horovod_{m}"], r[f"err_moving_horovod_{m}"]) > 1e-2
            else:
                assert "fused" in r[f"error_horovod_{m}"], r[f"error_horovod_{m}"]

"""Keras 3 on ``KERAS_BACKEND=torch`` through ``import hvd_balance.keras as hvd``: jobs of 2
and 3 ranks under torchrun (support.torchrun: hard timeout, ranks killed after)."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from support import run_records
from support.torchrun import run_torchrun

SCRIPTS = "tests/keras_torch/rank_scripts/"


@pytest.mark.parametrize("sizes, syncbn", [  # 7,1 with SyncBN: in the long runs
    ("7,1", False), pytest.param("7,1", True, marks=pytest.mark.slow), ("5,1,10", True)])
def test_keras_on_torch_weighted_update_equals_one_process_on_the_global_batch(sizes, syncbn):
    ranks = len(sizes.split(","))
    run = run_torchrun(SCRIPTS + "exact_update.py", nproc=ranks, timeout=150,
                       args=[sizes] + (["syncbn"] if syncbn else []))
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert sorted(results) == list(range(ranks))
    for rank, r in results.items():
        assert len(r["diffs"]) == 3 and max(r["diffs"]) < 1e-5, r
        assert set(r["local_batches"]) == {int(sizes.split(",")[rank])}
        # WeightedMetricAverage: the epoch loss is the mean over the global epoch's samples
        assert abs(r["loss"] - r["reference_loss"]) < 1e-5, r


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_keras_on_another_backend_is_refused_at_import_naming_it(backend):
    env = dict(os.environ, KERAS_BACKEND=backend)
    done = subprocess.run([sys.executable, "-c", "import hvd_balance.keras"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: hvd_balance needs Keras's TensorFlow or torch backend, "
                           f"but Keras is set to {backend!r}") and "KERAS_BACKEND=torch" in last


def test_keras_on_torch_rank_that_dies_ends_the_job_within_60_s_naming_it():
    start = time.monotonic()
    run = run_torchrun(SCRIPTS + "train.py", nproc=2, timeout=90, args=["die"])
    assert time.monotonic() - start < 60
    assert run.returncode != 0
    assert "rank      : 1 (local_rank: 1)" in run.stdout and "SIGKILL" in run.stdout


def test_keras_on_torch_bad_input_fails_on_every_rank_naming_the_value(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("format_version: 1\nworld_size: 2\nglobal_batch_size: 64\nranks:\n"
                    "- {local_batch: 70}\n- {local_batch: -6}\n")
    for args, message in [(["bad_batch"], "global_batch_size differs across ranks: rank 0: 64, "
                                          "rank 1: 48"),
                          (["plan", path], "ranks[1].local_batch must be an integer >= 0; got -6"),
                          (["bad_steps"], "fit runs 5 steps an epoch (steps_per_epoch) but the "
                                          "data has 24")]:
        run = run_torchrun(SCRIPTS + "train.py", nproc=2, timeout=90, args=args)
        results = run.results()
        assert sorted(results) == [0, 1], run.stdout[-3000:]
        for r in results.values():
            assert r["error"] and message in r["error"], r


def test_keras_on_torch_load_balancer_moves_work_off_a_slowed_rank():
    run = run_torchrun(SCRIPTS + "train.py", nproc=2, timeout=200, args=["slow", "3"])
    results = run.results()
    assert sorted(results) == [0, 1], run.stdout[-3000:]
    assert results[0]["plans"] == results[1]["plans"]
    final = results[0]["plans"][-1]
    assert sum(final) == 64 and final[1] < 24, final
    # On so small a model the allreduce can cost more than rank 1 brings: it may be left out,
    # and then runs one probe step an epoch.
    assert results[0]["steps"] == [24, 24, 24]
    assert results[1]["steps"] == [24 if plan[1] else 1 for plan in results[0]["plans"]]


@pytest.mark.parametrize("step", [6, 23])
def test_keras_on_torch_stop_training_mid_epoch_on_one_rank_stops_every_rank_there(step):
    # 23 of 24: the other rank may finish its epoch without meeting the stop in a step
    start = time.monotonic()
    run = run_torchrun(SCRIPTS + "train.py", nproc=2, timeout=90, args=["nan", "1", step])
    assert time.monotonic() - start < 30  # nobody waits for an answer (45 s)
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    why = "model.stop_training was set: TerminateOnNaN or a callback of its own"
    assert results[1]["steps"] == [step] and results[0]["steps"] in ([step], [step + 1]), results
    for rank in (0, 1):
        assert results[rank]["error"] is None
        assert results[rank]["stopped"] == {"rank": 1, "epoch": 0, "step": step, "steps": 24,
                                            "why": why}
        assert (f"hvd_balance: rank 1 left its training loop in epoch 0 after {step} of its 24 "
                f"steps ({why}); every rank stops there") in run.stdout
        assert f"[rank {rank}]" in run.stdout
    assert "did not answer" not in run.stdout


def test_keras_on_torch_stop_training_at_an_epoch_end_on_one_rank_stops_every_rank_there():
    run = run_torchrun(SCRIPTS + "train.py", nproc=2, timeout=90, args=["early", "0"])
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert results[0]["steps"] == results[1]["steps"] == [24]
    assert "hvd_balance: rank(s) [0] stopped training at the end of epoch 0" in run.stdout


def test_keras_on_torch_stop_training_by_a_callback_after_the_balancer_fails_every_rank_at_once():
    start = time.monotonic()
    run = run_torchrun(SCRIPTS + "train.py", nproc=2, timeout=90, args=["late", "0"])
    assert time.monotonic() - start < 60
    results = run.results()
    assert sorted(results) == [0, 1], run.stdout[-3000:]
    for r in results.values():
        assert r["error"].startswith("StopMismatchError: rank(s) [0] ended fit after epoch 0 while "
                                     "rank(s) [1] began another epoch"), r


@pytest.mark.parametrize("nproc, syncbn", [(2, False), (3, True)])
def test_keras_on_torch_rank_left_out_and_taken_back_keeps_the_update_exact(nproc, syncbn):
    """The last rank is out in epoch 1 (a scripted controller): its one probe step changes
    nothing, and every rank ends with the weights of one process trained on the same global
    batches (float32, to 1e-5); each epoch's averaged loss is that process's."""
    run = run_torchrun(SCRIPTS + "leave_out_exact.py", nproc=nproc, timeout=150,
                       args=["syncbn"] if syncbn else [])
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert sorted(results) == list(range(nproc))
    last = nproc - 1
    for rank, r in results.items():
        assert r["diff"] < 1e-5, (rank, r["diff"])
        np.testing.assert_allclose(r["loss"], r["reference_loss"], rtol=1e-5)
        steps = [(s["epoch"], s["batch"]) for s in r["steps"]]
        mine = {0: 8, last: 0}.get(rank, 4)
        assert steps == [(0, 4)] * 5 + ([(1, mine)] if mine == 0 else [(1, mine)] * 5) \
            + [(2, 4)] * 5, (rank, steps)
        assert {s["weight"] for s in r["steps"] if s["batch"] == 0} <= {1.0}
    windows = results[0]["windows"]
    assert [w["may_leave_out"] for w in windows] == [True] * 3
    assert windows[1]["left_out"] == [last]
    assert windows[1]["batches"][last] == results[0]["probe_batch"]
    said = [line for line in run.stdout.splitlines() if line.startswith("hvd_balance: rank")]
    assert said[0] == (f"hvd_balance: rank {last} left out from epoch 1: without them 1.0 ms "
                       f"predicted; they held {round(100 / nproc)} % of the samples"), said
    assert said[1].startswith(f"hvd_balance: rank {last} taken back from epoch 2: "), said
    assert "ran out of data" not in run.stdout


def test_keras_on_torch_leaves_a_costly_rank_out_and_every_rank_ends_equal(tmp_path):
    """Rank 1 sleeps 0.15 s a step in epochs 0 and 1: left out from epoch 1, that epoch runs
    at rank 0's own speed; both ranks end with the same weights. The run record says so."""
    run = run_torchrun(SCRIPTS + "train.py", nproc=2, timeout=150, args=["costly"],
                       env={run_records.ENV: str(tmp_path / "run.jsonl")})
    results = run.results()
    assert sorted(results) == [0, 1], run.stdout[-3000:]
    assert results[0]["error"] is None and results[0]["plans"] == results[1]["plans"]
    plans, epoch_s = results[0]["plans"], results[0]["epoch_s"]
    assert plans[1] == [64, 0], plans  # each epoch's last plan: rank 1 out in epoch 1
    assert results[0]["steps"][:2] == [24, 24] and results[1]["steps"][1] == 1
    assert epoch_s[1] < epoch_s[0] / 3, epoch_s
    assert results[0]["differs"] == results[1]["differs"] == 0.0
    assert "hvd_balance: rank 1 left out from epoch 1: with them a step takes " in run.stdout
    windows = run_records.windows_of(tmp_path / "run.jsonl", "keras-torch", 2, 64)
    assert [w["left_out"] for w in windows if w["epoch"] == 1] == [[1]], windows
    # Keras's History holds each epoch's last window (balance/...), on every rank
    logs = results[1]["logs"]
    assert logs["balance/rank1/local_batch"][1] == 0 and len(logs["balance/step_ms"]) == 3, logs

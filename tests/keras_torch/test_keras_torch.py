"""Keras 3 on ``KERAS_BACKEND=torch`` through ``import hvd_balance.keras as hvd``: jobs of 2
and 3 ranks under torchrun (support.torchrun: hard timeout, ranks killed after)."""

import os
import subprocess
import sys
import time

import pytest

from support.torchrun import run_torchrun

SCRIPTS = "tests/keras_torch/rank_scripts/"


@pytest.mark.parametrize("sizes, syncbn", [("7,1", False), ("7,1", True), ("5,1,10", True)])
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
    assert results[0]["steps"] == results[1]["steps"] == [24, 24, 24]


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

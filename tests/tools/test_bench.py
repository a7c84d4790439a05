"""hvd_balance.bench: the figures' formulas, the per-step timing on real ranks, and a smoke run."""

import doctest
import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from support import (can_emulate, kill_run_leftovers, launcher_group, PYTHON, REPO, rank_env,
                      run_command, run_pids, run_ranks, RUN_ID_VAR)
from hvd_balance.tools.bench import driver, figures, models, settings, worker

STEP_TIMING = "tests/rank_scripts/bench_step_timing.py"




needs_emulation = pytest.mark.skipif(not can_emulate(),
                                     reason="needs root and a cgroup cpu controller")


# ---------------------------------------------------------------------------------------
# The formulas (pure).


def test_ideal_speedup_of_a_four_to_one_pair_is_two_and_a_half():
    ideal = figures.ideal_speedup(busy_s=[0.1, 0.4], local_batches=[128, 128])
    assert ideal["samples_per_s"] == pytest.approx([1280.0, 320.0])
    assert ideal["uniform_step_s"] == pytest.approx(0.4)
    assert ideal["ideal_step_s"] == pytest.approx(256 / 1600)
    assert ideal["ideal_speedup"] == pytest.approx(2.5)


def test_ideal_speedup_is_max_busy_times_mean_inverse_busy():
    busy = [0.1, 0.2, 0.4, 0.4]
    ideal = figures.ideal_speedup(busy, [64] * 4)
    assert ideal["ideal_speedup"] == pytest.approx(max(busy) * sum(1 / b for b in busy) / 4)
    assert figures.ideal_speedup([0.3, 0.3], [100, 100])["ideal_speedup"] == pytest.approx(1.0)


def test_step_efficiency_is_mean_over_max_busy_per_step():
    eff = figures.step_efficiency([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    assert eff == pytest.approx([1.0, 0.75, 2 / 3])


def test_fixed_cost_limit_makes_every_rank_finish_together():
    # Rank 0: 10 ms + 1 ms/sample; rank 1: 20 ms + 4 ms/sample; B = 100.
    points = [[(b, 0.010 + 0.001 * b) for b in (50, 80)], [(b, 0.020 + 0.004 * b) for b in (20, 50)]]
    limit = figures.fixed_cost_limit(points, 100)
    assert limit["fixed_s"] == pytest.approx([0.010, 0.020])
    assert limit["per_sample_s"] == pytest.approx([0.001, 0.004])
    t = limit["limit_step_s"]
    assert (t - 0.010) / 0.001 + (t - 0.020) / 0.004 == pytest.approx(100)
    assert figures.fixed_cost_limit([[(50, 0.1), (51, 0.1)], points[1]], 100) is None


def _fake_job(strategy, rep, batches, busy, wait, epoch_s, bench_s=0.0):
    """A job result as the worker writes it: 2 epochs of 3 steps, constant per-rank times."""
    ranks = [{"rank": i, "local_batch": b, "epoch_s": epoch_s,
              "busy_s": [[busy[i]] * 3, [busy[i]] * 3], "wait_s": [[wait[i]] * 3, [wait[i]] * 3],
              "loss": [2.0, 1.5]} for i, b in enumerate(batches)]
    result = {"strategy": strategy, "local_batches": batches, "steps_per_epoch": 3,
              "benchmark_phase_s": bench_s, "benchmark_measure_s": bench_s / 2,
              "final_loss": 1.5, "ranks": ranks}
    return {"strategy": strategy, "rep": rep, "result": result,
            "summary": figures.summarize_job(result)}


def test_summary_holds_every_figure_per_strategy():
    jobs = [
        _fake_job("uniform", 0, [64, 64], busy=[0.1, 0.4], wait=[0.31, 0.01], epoch_s=[2.0, 1.3]),
        _fake_job("proportional", 0, [100, 28], busy=[0.16, 0.17], wait=[0.02, 0.01],
                  epoch_s=[1.0, 0.6], bench_s=0.05),
        _fake_job("balanced", 0, [102, 26], busy=[0.16, 0.16], wait=[0.01, 0.01],
                  epoch_s=[1.0, 0.52], bench_s=0.05),
    ]
    summary = figures.summarize(jobs, settings.STRATEGIES, 128)
    assert summary["ideal"]["ideal_speedup"] == pytest.approx(2.5)
    for name in settings.STRATEGIES:
        s = summary["strategies"][name]
        for key in ("epoch_s", "busy_s", "wait_s", "speedup", "ideal_speedup", "efficiency",
                    "benchmark_share", "benchmark_phase_s", "local_batches", "gap"):
            assert s[key] is not None, (name, key)
    bal = summary["strategies"]["balanced"]
    assert bal["speedup"] == pytest.approx(1.3 / 0.52)
    assert bal["fraction_of_ideal"] == pytest.approx(1.3 / 0.52 / 2.5)
    assert bal["efficiency"] == pytest.approx(1.0)
    assert summary["strategies"]["uniform"]["efficiency"] == pytest.approx(0.625)
    assert bal["benchmark_share"] == pytest.approx(0.05 / 1.57)
    assert summary["balanced_vs_proportional"]["epoch_time_ratio"] == pytest.approx(0.6 / 0.52)
    assert figures.targets(summary, [1.0, 0.25], [0, 0])["speedup_over_uniform>=2.0"]["met"]


def test_share_of_ideal_is_the_speedup_over_the_ideal_of_the_rates():
    # uniform's step is the slowest rank's, (B/N) / min r; the ideal one B / sum r
    assert figures.share_of_ideal(2.5, [640.0, 160.0]) == pytest.approx(1.0)
    assert figures.share_of_ideal(2.0, [640.0, 160.0]) == pytest.approx(0.8)
    assert figures.share_of_ideal(1.0, [100.0, 100.0, 100.0]) == pytest.approx(1.0)
    # --slowdown 1,2,4,4 on identical cores: rates r / k_i, ideal 4 * (1 + 1/2 + 1/4 + 1/4) / 4
    assert figures.share_of_ideal(1.84, [1.0, 0.5, 0.25, 0.25]) == pytest.approx(0.92)


def test_the_figures_docstring_examples_hold():
    result = doctest.testmod(figures)
    assert result.failed == 0 and result.attempted >= 5, result


def test_summary_prints_the_balanced_share_of_ideal_with_uniform_and_balanced(tmp_path):
    jobs = [
        _fake_job("uniform", 0, [64, 64], busy=[0.1, 0.4], wait=[0.31, 0.01], epoch_s=[2.0, 1.3]),
        _fake_job("balanced", 0, [102, 26], busy=[0.16, 0.16], wait=[0.01, 0.01],
                  epoch_s=[1.0, 0.65]),
    ]
    report = {"config": {"strategies": ["uniform", "balanced"], "global_batch": 128,
                         "shares": [1.0, 1.0], "step_delay_ms": [0, 0], "epochs": 2,
                         "slowdown": [1.0, 4.0]},
              "jobs": jobs}
    # finish() writes a temporary file beside its target and renames it over the target:
    # never os.devnull, which it would replace with a plain file for the whole machine.
    out = driver.finish(report, str(tmp_path / "report.json"))
    share = out["balanced_share_of_ideal"]
    assert share["value"] == pytest.approx((1.3 / 0.65) / 2.5)  # rates 640 and 160: ideal 2.5
    assert share["ideal_speedup_from_slowdown"] == pytest.approx(2.5)
    text = driver.format_summary(out)
    assert "balanced share of ideal: 0.800 (speedup 2.00x over uniform / ideal 2.50x" in text
    assert out["targets"]["balanced_share_of_ideal>=0.95"] == {"value": pytest.approx(0.8),
                                                               "met": False}
    # without balanced there is no such line
    alone = {"config": {**report["config"], "strategies": ["uniform"]}, "jobs": jobs[:1]}
    assert "share of ideal" not in driver.format_summary(driver.finish(alone, str(tmp_path / "alone.json")))


@pytest.mark.parametrize("argv, named", [
    (["--slowdown", "1,0.5"], "slowdown '0.5' (rank 1)"),
    (["--slowdown", "1,x"], "slowdown 'x' (rank 1) is not a number"),
])
def test_a_bad_slowdown_is_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        driver.main([*argv, "--out", os.devnull])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_a_slowdown_for_another_number_of_ranks_is_refused_by_name():
    with pytest.raises(SystemExit, match="--slowdown 1,4,4 has 3 values for the 2 ranks of "
                                         "--shares 1.0,0.25"):
        driver.main(["--slowdown", "1,4,4", "--shares", "1.0,0.25", "--out", os.devnull])
    with pytest.raises(SystemExit, match="--slowdown needs the emulation, not --hosts"):
        driver.main(["--slowdown", "1,4", "--hosts", "a:1,b:1", "--out", os.devnull])


def test_a_slowdown_alone_runs_every_rank_at_a_whole_core(monkeypatch):
    seen = {}
    monkeypatch.setattr(driver, "run_driver", lambda args, argv: seen.update(args=args) or 0)
    assert driver.main(["--slowdown", "1,2,4,4", "--smoke", "--out", os.devnull]) == 0
    args = seen["args"]
    assert args.shares == "1,1,1,1" and args.slowdown == (1.0, 2.0, 4.0, 4.0)
    command = driver.job_command(args, "uniform", "/tmp/job.json")
    launcher = command[:command.index("--")]
    assert launcher[launcher.index("--cpu-shares") + 1] == "1,1,1,1"
    assert launcher[launcher.index("--slowdown") + 1] == "1,2,4,4"


def test_a_start_from_equal_batches_is_charged_its_first_steps():
    """No benchmark phase: the start's cost is the first steps' excess over the plan they
    found (figures.calibration_cost), and it counts in the benchmark share."""
    ranks = [{"rank": i, "local_batch": 64, "epoch_s": [4.0, 2.0],
              # step 0 traces (3 s); steps 1-3 at 0.5 s; step 4 waits for its batch
              "busy_s": [[2.9, 0.4, 0.4, 0.4, 0.25] + [0.15] * 5, [0.15] * 10],
              "wait_s": [[0.1, 0.1, 0.1, 0.1, 0.05] + [0.05] * 5, [0.05] * 10],
              "loss": [2.0, 1.5]} for i in range(2)]
    result = {"strategy": "balanced", "local_batches": [100, 28], "steps_per_epoch": 10,
              "benchmark_phase_s": 0.01, "final_loss": 1.5, "ranks": ranks,
              "replans": [{"epoch": 0, "step": 4, "decision": "switched"},
                          {"epoch": 0, "step": 0, "decision": "kept"}]}
    s = figures.summarize_job(result)
    assert s["calibration_cost_s"] == pytest.approx(4 * (0.5 - 0.2) + (0.3 - 0.2))
    assert s["start_cost_s"] == pytest.approx(0.01 + 1.3)
    assert s["benchmark_share"] == pytest.approx(1.31 / (0.01 + 6.0))
    # A benchmark (its first round at an epoch's end) is charged its phase alone.
    result["replans"] = result["replans"][1:]
    assert figures.summarize_job(result)["start_cost_s"] == pytest.approx(0.01)


def test_accuracy_is_a_column_of_the_summary_and_its_table():
    jobs = [_fake_job(name, rep, [64, 64], busy=[0.1, 0.1], wait=[0.01, 0.01], epoch_s=[1.0, 1.0])
            for rep in range(3) for name in settings.STRATEGIES]
    accuracies = {"uniform": [0.5, 0.7, 0.6], "proportional": [0.61, 0.62, 0.63],
                  "balanced": [0.9, 0.8, 0.85]}
    for job in jobs:
        acc = accuracies[job["strategy"]][job["rep"]]
        job["result"]["accuracy"] = acc
        for i, r in enumerate(job["result"]["ranks"]):
            r["accuracy"] = acc - 0.1 * i  # rank 1's own batch-norm statistics do worse
        job["summary"] = figures.summarize_job(job["result"])
    summary = figures.summarize(jobs, settings.STRATEGIES, 128)
    for name, per_rep in accuracies.items():
        s = summary["strategies"][name]
        assert s["accuracy"] == pytest.approx(sorted(per_rep)[1])  # the median over repetitions
        assert s["accuracy_per_rep"] == per_rep
        assert s["accuracy_per_rank"] == pytest.approx([s["accuracy"], s["accuracy"] - 0.1])
    table = driver.format_summary({**summary, "targets": {}}).splitlines()
    assert "accuracy" in table[0].split()
    assert "0.8500" in next(line for line in table if line.startswith("balanced"))
    # A report from before the column (no accuracy in its jobs) still summarizes: "-".
    for job in jobs:
        del job["result"]["accuracy"]
        job["summary"] = figures.summarize_job(job["result"])
    old = figures.summarize(jobs, settings.STRATEGIES, 128)
    assert old["strategies"]["balanced"]["accuracy"] is None
    assert " - " in driver.format_summary({**old, "targets": {}}).splitlines()[1]


def test_paired_order_mirrors_every_two_pairs():
    order = settings.paired_order(8)
    assert order == ["default", "paper", "paper", "default"] * 2
    assert all(sorted(order[k:k + 2]) == ["default", "paper"] for k in range(0, 8, 2))


def _paired_result(steps_ms, order, first=3):
    """A paired job's records: rank 0's compared epochs last ``steps_ms`` a step (its first
    step 5 s, which the comparison leaves out), after ``first`` epochs of finding the plans."""
    busy = [[1.0] * 4] * first + [[5.0] + [ms / 1e3] * 3 for ms in steps_ms]
    return {"ranks": [{"busy_s": busy, "wait_s": [[0.0] * 4] * len(busy)}],
            "paired": {"paper": [300, 212], "default": [310, 202], "order": order,
                       "first_compared": first}}


def test_a_paired_job_compares_its_plans_pair_by_pair():
    order = settings.paired_order(4)  # default paper paper default
    result = _paired_result([100, 110, 120, 100], order)
    c = figures.paired_comparison(result)
    assert c["default_step_s"] == pytest.approx([0.100, 0.100])
    assert c["paper_step_s"] == pytest.approx([0.110, 0.120])
    assert c["pair_ratios"] == pytest.approx([1.10, 1.20])
    assert c["ratio"] == pytest.approx(0.115 / 0.100)
    assert figures.paired_comparison({"ranks": result["ranks"]}) is None  # not a paired job
    # Over jobs: the median of every pair's ratio, and the line of the table.
    jobs = [{"strategy": "paired", "rep": rep, "summary": {"paired": figures.paired_comparison(
        _paired_result(steps, order))}} for rep, steps in enumerate(
        [[100, 110, 120, 100], [100, 95, 99, 100]])]
    for job in jobs:  # summarize needs every figure of a job; only "paired" matters here
        job["summary"].update(_minimal_summary())
    summary = figures.summarize(jobs, ["paired"], 512)
    others = [{**job, "strategy": "balanced"} for job in jobs]
    assert "paired" not in figures.summarize(others, ["balanced"], 512)  # paired jobs only
    paired = summary["paired"]
    assert paired["paper_over_default_step"] == pytest.approx((0.99 + 1.1) / 2)  # of 4 pairs
    assert paired["pair_ratios_per_rep"] == [pytest.approx([1.1, 1.2]), pytest.approx([0.95, 0.99])]
    line = next(l for l in driver.format_summary({**summary, "targets": {}}).splitlines()
                if l.startswith("paired, "))
    assert "paper / default step time: 1.045 (median of 4 pairs;" in line  # too few for 95 %
    # Six pairs: [min, max] covers the median with probability 1 - 2 / 2**6.
    jobs.append({**jobs[0], "rep": 2})
    jobs[2]["summary"] = {**jobs[0]["summary"], "paired": figures.paired_comparison(
        _paired_result([100, 90, 130, 100], order))}
    summary = figures.summarize(jobs, ["paired"], 512)
    assert summary["paired"]["interval_95"] == pytest.approx(
        {"low": 0.9, "high": 1.3, "coverage": 1 - 2 / 64})
    line = next(l for l in driver.format_summary({**summary, "targets": {}}).splitlines()
                if l.startswith("paired, "))
    assert "(median of 6 pairs, 95 % interval 0.900-1.300;" in line


def test_the_control_is_summarized_apart_from_the_paired_jobs():
    order = settings.paired_order(4)
    jobs = [{"strategy": strategy, "rep": 0, "summary": {
        "paired": figures.paired_comparison(_paired_result(steps, order)), **_minimal_summary()}}
        for strategy, steps in (("paired", [100, 110, 120, 100]), ("control", [100, 98, 103, 100]))]
    summary = figures.summarize(jobs, ["paired", "control"], 512)
    assert summary["paired"]["pair_ratios_per_rep"] == [pytest.approx([1.10, 1.20])]
    assert summary["control"]["pair_ratios_per_rep"] == [pytest.approx([0.98, 1.03])]
    assert summary["control"]["paper_over_default_step"] == pytest.approx(1.005)
    lines = driver.format_summary({**summary, "targets": {}}).splitlines()
    assert any(l.startswith("paired, paper / default step time: 1.150 (median of 2 pairs")
               for l in lines)
    assert any(l.startswith("control (A/A), paper / paper step time: 1.005 (median of 2 pairs")
               for l in lines)


def test_the_interval_of_a_median_is_the_innermost_order_statistics_that_cover_it():
    ratios = [1.0 + k / 100 for k in range(12)]  # 1.00 ... 1.11, shuffled below
    interval = figures.median_interval(ratios[::-1][::2] + ratios[::-1][1::2])
    # k = 3: 1 - 2 P(Binomial(12, 1/2) <= 2) = 1 - 2 (1 + 12 + 66) / 4096 = 0.961; k = 4: 0.854.
    assert interval == pytest.approx({"low": 1.02, "high": 1.09, "coverage": 1 - 158 / 4096})
    assert figures.median_interval(ratios, coverage=0.8) == pytest.approx(
        {"low": 1.03, "high": 1.08, "coverage": 1 - 2 * 299 / 4096})
    assert figures.median_interval(ratios[:5]) is None  # [min, max] of 5 covers 0.9375
    assert figures.median_interval([]) is None


def _minimal_summary():
    return {"busy_s": [0.1, 0.1], "wait_s": [0.01, 0.01], "local_batches": [310, 202],
            "steps_per_epoch": 4, "steady_epoch_s": 0.4, "epoch_s": [1.0, 0.4], "step_s": 0.1,
            "efficiency": 1.0, "efficiency_ceiling": 1.0, "efficiency_total": 1.0,
            "benchmark_phase_s": 0.0, "benchmark_share": 0.0, "benchmark_share_5_epochs": 0.0,
            "run_s": 1.4, "busy_over_predicted": None, "final_loss": 1.0}


def test_the_paired_strategy_needs_pairs_of_epochs_of_2_steps():
    with pytest.raises(SystemExit, match="--epochs must be even; got 3"):
        driver.main(["--strategies", "uniform, paired", "--epochs", "3", "--out", "/dev/null"])
    with pytest.raises(SystemExit, match="the control strategy .* --epochs must be even; got 5"):
        driver.main(["--strategies", "control", "--epochs", "5", "--out", "/dev/null"])
    with pytest.raises(SystemExit, match="2 steps an epoch or more; --samples 600 gives 1"):
        driver.main(["--strategies", "paired", "--epochs", "2", "--samples", "600",
                     "--global-batch", "512", "--out", "/dev/null"])


def _round(epoch, step=0, decision="kept"):
    return {"epoch": epoch, "step": step, "decision": decision}


@pytest.mark.parametrize("history, epoch, settled", [
    ([_round(1, step=3, decision="switched"), _round(1), _round(2)], 2, True),  # kept twice
    ([_round(1, step=3, decision="switched"), _round(1, decision="reverted")], 1, True),
    ([_round(1), _round(2, decision="switched")], 2, False),  # a switch not yet measured
    ([_round(1), _round(2, step=3, decision="switched")], 2, False),  # mid-epoch: no round's end
    ([_round(1), _round(2)], 3, False),  # no round at this epoch's end
    ([_round(1, decision="switched"), _round(2)], 2, False),  # one window of these batches only
    ([_round(1, decision=None), _round(2, decision=None)], 2, False),  # nothing decided
])
def test_the_default_settles_on_a_revert_or_two_rounds_that_kept_its_plan(history, epoch, settled):
    assert worker._settled(history, epoch) is settled


@pytest.mark.parametrize("make", [models.make_images, models.make_tokens])
def test_realistic_data_is_seeded_and_held_out_apart(make):
    import numpy as np

    x, y, x_test, y_test = make(600, 200, seed=3)
    again = make(600, 50, seed=3)
    # The same seed gives the same training set whatever the held-out size, and held-out
    # samples of the same distribution, not copies of training ones.
    assert np.array_equal(again[0], x) and np.array_equal(again[1], y)
    assert all(np.array_equal(a, b) for a, b in zip(make(600, 200, seed=3), (x, y, x_test, y_test)))
    assert not np.array_equal(make(600, 0, seed=4)[0], x)
    assert len(x) == len(y) == 600 and len(x_test) == len(y_test) == 200
    assert y.dtype == np.int32 and set(np.unique(y)) == set(range(models.CLASSES))
    flat, flat_test = x.reshape(len(x), -1), x_test.reshape(len(x_test), -1)
    assert not (flat_test[:, None, :] == flat[None, :, :]).all(-1).any()
    if make is models.make_images:
        assert x.shape[1:] == models.IMAGE_SHAPE and x.dtype == np.float32
    else:
        assert x.shape[1:] == (models.SEQ_LEN,) and x.dtype == np.int32
        assert 0 <= x.min() and x.max() < models.VOCAB


def test_cnn_and_mlp_data_are_unchanged_by_a_held_out_set():
    """The held-out samples are drawn after the training ones: the existing models train on
    the data they always did (Gaussian inputs, labels of a fixed random linear map)."""
    import numpy as np

    for shape in ((16, 16, 1), (256,)):
        rng = np.random.default_rng(5)
        x_old = rng.standard_normal((40,) + shape, dtype=np.float32)
        w = rng.standard_normal((int(np.prod(shape)), 10), dtype=np.float32)
        y_old = np.argmax(x_old.reshape(40, -1) @ w, axis=1)
        for heldout in (0, 16):
            x, y, x_test, y_test = worker.model_data("cnn", shape, 40, heldout, seed=5)
            assert np.array_equal(x, x_old) and np.array_equal(y, y_old)
            assert x_test.shape == (heldout,) + shape and len(y_test) == heldout
        assert all(np.array_equal(a, b) for a, b in zip(worker.make_data(shape, 40, 5), (x, y)))


def test_token_data_is_learnable_by_counting():
    """Naive Bayes on token counts, fitted on the training sequences, is far above chance on
    the held-out ones: the labels carry a signal a model can learn."""
    import numpy as np

    x, y, x_test, y_test = models.make_tokens(4000, 1000, seed=0)
    counts = np.ones((models.CLASSES, models.VOCAB))
    for c in range(models.CLASSES):
        np.add.at(counts[c], x[y == c].ravel(), 1)
    log_p = np.log(counts / counts.sum(1, keepdims=True))
    accuracy = float(np.mean(np.argmax(log_p[:, x_test].sum(-1), axis=0) == y_test))
    assert accuracy > 0.6, accuracy  # chance: 0.1


@pytest.mark.skipif(models.sync_batch_norm_available(),
                    reason="hvd_balance.SyncBatchNormalization exists in this checkout")
def test_sync_batch_norm_is_refused_by_name_until_it_exists(capsys):
    with pytest.raises(SystemExit, match="--batch-norm sync needs hvd_balance.SyncBatchNormalization"):
        driver.main(["--model", "resnet", "--batch-norm", "sync", "--out", "/dev/null"])


def test_importing_the_driver_leaves_tensorflow_out():
    code = "import sys, hvd_balance.bench; print('tensorflow' in sys.modules)"
    done = subprocess.run([PYTHON, "-c", code], env=rank_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


@pytest.mark.timeout(60)
def test_help_names_the_strategies_and_options():
    done = subprocess.run([PYTHON, "-m", "hvd_balance.bench", "--help"], env=rank_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for option in ("--shares", "--step-delay-ms", "--reps", "--global-batch", "--smoke", "--plot"):
        assert option in done.stdout


# ---------------------------------------------------------------------------------------
# Real ranks.


@pytest.mark.timeout(240)
@pytest.mark.parametrize("batch_norm", ["none"])  # SyncBN: test_sync_batch_norm_timing.py
def test_busy_and_wait_split_a_step_and_a_delay_counts_as_busy(batch_norm):
    # "sync": rank 0 waits for the delayed rank inside SyncBatchNormalization's allreduces,
    # which still count as its wait, not busy, time (and the benchmark step syncs nothing)
    delay_ms = 80
    run = run_ranks(STEP_TIMING, np=2, args=[str(delay_ms), batch_norm], timeout=200)
    assert run.returncode == 0, run.stdout[-3000:]
    result = run.results()
    assert result.keys() == {0, 1}, run.stdout[-3000:]
    r0, r1 = result[0], result[1]
    assert r0["steps"] == r1["steps"] == [12, 12]
    delay_s = delay_ms / 1e3
    # The delayed rank is busy for the delay longer, and the other rank waits for it.
    assert r1["busy_s"] - r0["busy_s"] == pytest.approx(delay_s, abs=0.03), result
    assert r0["wait_s"] - r1["wait_s"] == pytest.approx(delay_s, abs=0.03), result
    # Busy + wait is the synchronous step, the same on both ranks.
    assert r0["step_s"] == pytest.approx(r1["step_s"], abs=0.02), result
    # The LoadBalancer's benchmark step pays the delay too; inference does not.
    assert r1["bench_step_s"] >= delay_s > r0["bench_step_s"], result
    assert r1["predict_s"] < r0["predict_s"] + delay_s / 2, result


@pytest.mark.slow  # the realistic models' training: the CNN's (the smoke run) is the one in CI
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, batch_norm, samples, epochs", [
    pytest.param("resnet", "sync", 256, 1, id="resnet-sync", marks=pytest.mark.skipif(
        not models.sync_batch_norm_available(), reason="no hvd_balance.SyncBatchNormalization yet")),
    pytest.param("text", "local", 2048, 2, id="text")])
def test_realistic_model_trains_on_two_ranks_and_reports_held_out_accuracy(
        tmp_path, model, batch_norm, samples, epochs):
    """The worker's job, balanced (weighted optimizer and LoadBalancer), on 2 plain ranks."""
    job_out = tmp_path / "job.json"
    cmd = [PYTHON, "-m", "hvd_balance.bench", "--worker", "--strategy", "balanced",
           "--model", model, "--batch-norm", batch_norm, "--epochs", str(epochs), "--global-batch", "64",
           "--samples", str(samples), "--heldout", "200", "--benchmark-repeats", "1",
           "--benchmark-batches", "8,16", "--job-out", job_out]
    run = run_ranks(cmd, np=2, timeout=260)
    assert run.returncode == 0, run.stdout[-3000:]
    result = json.loads(job_out.read_text())
    assert result["model"] == model and result["heldout"] == 200
    assert result["batch_norm"] == (batch_norm if model == "resnet" else None)
    assert sum(result["local_batches"]) == 64
    assert result["steps_per_epoch"] == samples // 64
    ranks = result["ranks"]
    assert [[len(steps) for steps in r["busy_s"]] for r in ranks] == [[samples // 64] * epochs] * 2
    accuracies = [r["accuracy"] for r in ranks]
    assert result["accuracy"] == accuracies[0]
    # 200 held-out samples: an accuracy is a whole number of them.
    assert all(0 <= a <= 1 and round(a * 200, 6) == round(a * 200) for a in accuracies)
    if model == "text" or batch_norm == "sync":
        # No per-rank state: every rank holds the same model, so the same accuracy.
        assert accuracies[0] == accuracies[1], accuracies
    if model == "text":
        # 64 Adam steps on sparse (Embedding) gradients learn: chance is 0.1 (after 32 steps
        # 0.20-0.29 measured, the plan changing which samples make each step).
        assert accuracies[0] > 0.3, accuracies
    assert figures.summarize_job(result)["accuracy"] == accuracies[0]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@needs_emulation
@pytest.mark.timeout(180)
def test_others_cpu_is_unknown_when_the_ranks_run_on_other_hosts(tmp_path):
    """With ``--hosts`` the ranks run under each host's sshd, not as the driver's children, so
    their CPU would count as other people's: the report says it does not know."""
    burn = [PYTHON, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"]
    here = driver.run_job(burn, dict(os.environ), str(tmp_path / "here.log"), 60)
    away = driver.run_job(burn, dict(os.environ), str(tmp_path / "away.log"), 60,
                          ranks_are_children=False)
    assert here["returncode"] == away["returncode"] == 0
    assert here["cpu_s_ours"] >= 0.3 and here["others_cores"] >= 0.0
    assert away["others_cores"] is None and away["cpu_s_others"] is None
    assert driver._fmt_cores(None) == "n/a (ranks on other hosts)"


def test_a_driver_stopped_by_sigterm_stops_its_job_and_leaves_nothing(tmp_path):
    """The jobs run in their own sessions: SIGTERM to the driver must reach them."""
    from hvd_balance.tools import emulate

    run_id = uuid.uuid4().hex
    driver = subprocess.Popen(
        [PYTHON, "-m", "hvd_balance.bench", "--smoke", "--out", str(tmp_path / "smoke.json"),
         "--job-timeout", "120"], cwd=REPO, env={**rank_env(), RUN_ID_VAR: run_id},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    groups = []
    try:
        deadline = time.monotonic() + 90
        while True:  # until a rank of the first job runs in its launcher's group
            commands = {pid: _cmdline(pid) for pid in run_pids(run_id)}
            launchers = [pid for pid, c in commands.items() if "hvd_balance.emulate" in c]
            ranks = [pid for pid, c in commands.items() if "bench --worker" in c
                     and "hvd_balance.emulate" not in c and "horovodrun" not in c]
            groups = [launcher_group(pid) for pid in launchers]
            if ranks and groups and all(os.path.isdir(g) for g in groups):
                break
            assert driver.poll() is None and time.monotonic() < deadline, commands
            time.sleep(0.2)
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(60) == 128 + signal.SIGTERM
        gone_by = time.monotonic() + 10  # exiting processes (the resource tracker) may linger
        while run_pids(run_id) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert {pid: _cmdline(pid) for pid in run_pids(run_id)} == {}
        assert not any(os.path.exists(g) for g in groups), groups
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        kill_run_leftovers(run_id)
        for group in groups:  # only if the test failed: the launcher removes its own
            emulate.remove_group_tree(group)


@needs_emulation
@pytest.mark.timeout(480)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_smoke_benchmark_reports_every_figure(tmp_path):
    out, png = tmp_path / "smoke.json", tmp_path / "smoke.png"
    # A job takes about 45 s here, most of it TensorFlow's and Horovod's start.
    done = run_command(
        [PYTHON, "-m", "hvd_balance.bench", "--smoke", "--out", out, "--plot", png,
         "--job-timeout", "150"], rank_env(), timeout=460, emulated=True)
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads(out.read_text())
    assert png.stat().st_size > 5000
    assert report["config"]["shares"] == [1.0, 0.5] and report["config"]["reps"] == 1
    assert len(report["jobs"]) == 3 and all(j["returncode"] == 0 for j in report["jobs"])
    assert report["ideal"]["ideal_speedup"] > 0
    for name in settings.STRATEGIES:
        s = report["strategies"][name]
        assert len(s["busy_s"]) == len(s["wait_s"]) == 2
        assert all(t > 0 for t in s["busy_s"] + s["wait_s"]), s
        assert s["epoch_s"] > 0 and len(s["all_epoch_s_per_rep"][0]) == 2
        for key in ("speedup", "ideal_speedup", "fraction_of_ideal", "efficiency",
                    "benchmark_share", "step_s", "gap"):
            assert s[key] is not None, (name, key)
        assert sum(s["local_batches"]) == 256
    assert report["strategies"]["uniform"]["local_batches"] == [128, 128]
    assert report["strategies"]["uniform"]["benchmark_share"] == 0
    balanced = report["strategies"]["balanced"]
    assert len(set(balanced["local_batches"])) > 1, balanced["local_batches"]
    assert 0 < balanced["benchmark_share"] < 1
    assert "efficiency>=0.95" in report["targets"]


@needs_emulation
@pytest.mark.slow  # the paired harness's full job (147 s here); the smoke run covers a job
@pytest.mark.timeout(560)
def test_a_paired_job_runs_each_plan_in_the_epochs_it_names(tmp_path):
    out = tmp_path / "paired.json"
    done = run_command(
        [PYTHON, "-m", "hvd_balance.bench", "--smoke", "--strategies", "paired,control",
         "--out", out, "--job-timeout", "150"], rank_env(), timeout=540, emulated=True)
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads(out.read_text())
    assert [job["strategy"] for job in report["jobs"]] == ["paired", "control"]
    result = report["jobs"][0]["result"]
    paired, first = result["paired"], result["paired"]["first_compared"]
    assert paired["order"] == ["default", "paper"] and 2 <= first <= 1 + settings.PAIRED_FIND_EPOCHS
    rounds = [r for r in result["replans"] if r["step"] == 0]  # the default's epoch-end rounds
    assert [r["epoch"] for r in rounds] == list(range(1, first))  # one per epoch of its own
    assert paired["settled"] or first == 1 + settings.PAIRED_FIND_EPOCHS  # else it went on
    assert sum(paired["paper"]) == sum(paired["default"]) == 256
    assert paired["paper"][0] > paired["paper"][1]  # the full core got more than the half core
    for rank, record in enumerate(result["ranks"]):
        assert len(record["epoch_s"]) == first + 2
        assert record["local_batch_per_epoch"][0] == paired["paper"][rank]  # the paper's epoch
        for k, name in enumerate(paired["order"]):  # the compared epochs ran the plan named
            assert record["local_batch_per_epoch"][first + k] == paired[name][rank]
    comparison = report["jobs"][0]["summary"]["paired"]
    assert len(comparison["pair_ratios"]) == 1 and comparison["pair_ratios"][0] > 0
    assert report["paired"]["paper_over_default_step"] == comparison["pair_ratios"][0]
    assert "paired, paper / default step time:" in done.stdout
    assert paired["control"] is False and paired["found"] == paired["default"]
    # The control: the same job, with the paper's plan in the default's epochs too.
    control = report["jobs"][1]["result"]
    first = control["paired"]["first_compared"]
    assert control["paired"]["control"] is True
    assert control["paired"]["default"] == control["paired"]["paper"]
    assert control["local_batches"] == control["paired"]["paper"]
    assert control["plan"]["batch_sizes"] == control["paired"]["paper"]  # the plan its row ran
    assert sum(control["paired"]["found"]) == 256
    for rank, record in enumerate(control["ranks"]):
        assert record["local_batch_per_epoch"][first:] == [control["paired"]["paper"][rank]] * 2
    assert report["control"]["pair_ratios_per_rep"] == [
        report["jobs"][1]["summary"]["paired"]["pair_ratios"]]
    assert "control (A/A), paper / paper step time:" in done.stdout

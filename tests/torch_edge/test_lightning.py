"""hvd_balance.lightning: a Lightning Trainer with BalancedDDPStrategy on 2 and 3 CPU ranks
under torchrun (support.torchrun: hard timeout, ranks killed after), and the example."""

import csv
import re

import pytest

from support import run_records
from support.launch import PYTHON, REPO, rank_env, run_command
from support.torchrun import run_torchrun

pytest.importorskip("lightning", reason="Lightning (the torch stack, scripts/install.sh)")

SCRIPT = "tests/torch_edge/rank_scripts/lightning_fit.py"


def close(a, b, rel=1e-9):
    return abs(a - b) <= rel * max(abs(b), 1e-12)


@pytest.mark.parametrize("nproc, mode, syncbn", [  # the plain-batch-norm mixes: in the long runs
    pytest.param(2, "plan:9,3", False, marks=pytest.mark.slow), (3, "plan:12,1,5", True),
    pytest.param(3, "caps:2,-,-", False, marks=pytest.mark.slow), (2, "caps:4,-", True),
    (2, "switch:9,3", True)])
def test_trainer_fit_equals_one_process_on_the_global_batch(nproc, mode, syncbn):
    """switch: the plan changes mid-epoch at windows every 2 steps, with validation twice an
    epoch, 2 loader workers and a second fit (a new DDP model) for a third epoch."""
    run = run_torchrun(SCRIPT, nproc=nproc, timeout=150, args=[mode] + (["syncbn"] if syncbn else []))
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert sorted(results) == list(range(nproc))
    kind, _, values = mode.partition(":")
    first = results[0]
    B, steps, epochs = first["B"], first["steps"], first["epochs"]
    for rank, r in results.items():
        assert r["relative"] < 1e-9, (rank, r["relative"])
        assert r["seed"] == 7  # seed_everything's
        if syncbn:  # hvd_balance's batch norm in the fit, the user's class back after it
            assert r["norms"] == ["SyncBatchNorm", "BatchNorm1d"]
        # Lightning's logged loss, on step and on epoch (sync_dist=True), is one process's.
        assert len(r["step_losses"]) == len(r["ref_step"]) == epochs * steps
        assert len(r["epoch_losses"]) == len(r["ref_epoch"]) == epochs
        assert all(close(a, b) for a, b in zip(r["step_losses"], r["ref_step"])), r
        assert all(close(a, b) for a, b in zip(r["epoch_losses"], r["ref_epoch"])), r
        if kind == "plan":
            assert set(r["local"]) == {int(values.split(",")[rank])}
        elif kind == "switch":  # both plans ran, and not only from an epoch's start
            local = r["local"]
            assert set(local) == {B // nproc, int(values.split(",")[rank])}
            assert any(local[s] != local[s - 1] for s in range(1, len(local)) if s % steps), local
        else:
            cap = values.split(",")[rank]
            assert cap == "-" or max(r["local"]) <= int(cap)
            assert r["caps"][rank] == (None if cap == "-" else int(cap))
    if kind == "caps":  # the cap binds: an equal share would exceed it
        assert int(values.split(",")[0]) < B // nproc
    # Every step covers B different samples; no sample twice in an epoch.
    for epoch in range(epochs):
        seen = []
        for step in range(epoch * steps, (epoch + 1) * steps):
            batch = [i for r in results.values() for i in r["seen"][step]]
            assert len(batch) == B
            seen += batch
        assert len(set(seen)) == len(seen) == steps * B


def test_accumulated_gradients_fail_on_every_rank_naming_the_value():
    run = run_torchrun(SCRIPT, nproc=2, timeout=120, args=["accumulate:2"])
    assert run.returncode != 0
    for rank in (0, 1):
        assert f"[rank{rank}]: ValueError: BalancedDDPStrategy needs accumulate_grad_batches=1; " \
               "got 2" in run.stdout, run.stdout[-3000:]


def test_the_example_trains_under_lightnings_own_launcher():
    """examples/lightning_mixed_gpus.py as a user runs it (Lightning starts the second rank)."""
    run = run_command([PYTHON, REPO / "examples" / "lightning_mixed_gpus.py", "--accelerator",
                       "cpu", "--devices", "2"], rank_env(), timeout=150)
    assert run.returncode == 0, run.stdout[-3000:]
    found = re.search(r"train_loss ([0-9.]+), val_accuracy ([0-9.]+), local batches "
                      r"\[(\d+), (\d+)\]", run.stdout)
    assert found, run.stdout[-3000:]
    assert int(found[3]) + int(found[4]) == 128
    assert float(found[2]) > 0.9 and float(found[1]) < 0.3, found[0]


def test_the_strategy_moves_work_off_a_slowed_rank_and_stays_exact(tmp_path):
    """Also: every window's line reaches the run's record, the console (verbose=2) and the
    Trainer's logger (a CSVLogger's metrics.csv)."""
    run = run_torchrun(SCRIPT, nproc=2, timeout=150, args=["slow:1"],
                       env={run_records.ENV: str(tmp_path / "run.jsonl"),
                            "LIGHTNING_FIT_LOGS": str(tmp_path / "logs")})
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert results[0]["plans"] == results[1]["plans"]
    final = results[0]["plans"][-1]
    assert sum(final) == 12 and final[1] <= 3, results[0]["plans"]  # its sleep alone is 2 ms/sample
    assert max(r["relative"] for r in results.values()) < 1e-9
    windows = run_records.windows_of(tmp_path / "run.jsonl", "lightning", 2, 12)
    assert [w["next_batch_sizes"] for w in windows] == \
        [h["next_batch_sizes"] for h in results[0]["history"]]
    assert windows[-1]["ranks"][1]["busy_ms"] > 0
    said = [line for line in run.stdout.splitlines() if "hvd_balance: window " in line]
    last = [r["local_batch"] for r in windows[-1]["ranks"]]
    assert len(said) == len(windows) and f"batches {last}" in said[-1], said  # rank 0 alone
    with open(tmp_path / "logs" / "fit" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("balance/step_ms")]
    assert len(rows) == len(windows), rows
    assert [float(r["balance/rank1/local_batch"]) for r in rows] == \
        [w["ranks"][1]["local_batch"] for w in windows]
    summary = run_records.drawn(tmp_path / "run.jsonl", tmp_path / "report.png")
    assert f"lightning, 2 ranks, global batch 12, {len(windows)} windows" in summary, summary


def test_the_layer_sync_plugin_converts_and_reverts_every_batch_norm():
    """Lightning's sync_batchnorm=True applies BalancedSyncBatchNorm at fit and reverts it at
    teardown: the original classes come back, with the same parameters and buffers."""
    import torch
    import hvd_balance.lightning as hbl
    import hvd_balance.torch as hb

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2),
                                torch.nn.Flatten(), torch.nn.BatchNorm1d(8))
    model[1].running_mean.fill_(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plugin = hbl.BalancedSyncBatchNorm()
    synced = plugin.apply(model)
    assert [type(m) for m in synced if isinstance(m, hb.SyncBatchNorm)] == [hb.SyncBatchNorm] * 2
    back = plugin.revert(synced)
    assert [type(m) for m in back] == [torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Flatten,
                                       torch.nn.BatchNorm1d]
    assert all(torch.equal(v, before[k]) for k, v in back.state_dict().items())


def test_lightning_s_cluster_environment_names_its_launcher():
    from lightning.pytorch.plugins.environments import (LightningEnvironment, SLURMEnvironment,
                                                        TorchElasticEnvironment)
    from hvd_balance.lightning import launcher_of

    assert [launcher_of(e()) for e in (LightningEnvironment, SLURMEnvironment,
                                       TorchElasticEnvironment)] == ["lightning", "srun", "torchrun"]

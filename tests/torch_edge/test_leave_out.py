"""Leaving ranks out on the torch edge, for real: 2 and 3 ranks under torchrun (hard timeout)."""

import pytest

from hvd_balance.core.plan import Plan
from support import run_records
from support.torchrun import run_torchrun

SCRIPTS = "tests/torch_edge/rank_scripts/"


@pytest.mark.parametrize("nproc, syncbn", [  # the other two mixes: in the long runs
    (2, False), pytest.param(3, False, marks=pytest.mark.slow),
    pytest.param(2, True, marks=pytest.mark.slow), (3, True)])
def test_a_rank_left_out_and_taken_back_keeps_the_update_exact(nproc, syncbn):
    """The last rank is out in epoch 1 (a scripted controller): its one probe step changes
    nothing, the others train on every step's B samples, and after it is taken back every
    rank's weights equal one process trained on the same global batches (float64)."""
    run = run_torchrun(SCRIPTS + "leave_out_exact.py", nproc=nproc, timeout=150,
                       args=["syncbn"] if syncbn else [])
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert sorted(results) == list(range(nproc))
    B, last = results[0]["B"], nproc - 1
    for rank, r in results.items():
        assert r["relative"] < 1e-9, (rank, r["relative"])
        out = [s for s in r["steps"] if s["left_out"]]
        if rank == last:  # epoch 1: one probe step of its own, of probe_batch samples
            assert [(s["epoch"], len(s["indices"]), s["weight"]) for s in out] == [
                (1, r["probe_batch"], 1.0)]
        else:
            assert not out
    for epoch in range(3):
        training = {rank: [s for s in r["steps"] if s["epoch"] == epoch and not s["left_out"]]
                    for rank, r in results.items()}
        counts = {len(steps) for steps in training.values() if steps}
        assert counts == {5}, (epoch, counts)
        seen = [i for steps in training.values() for s in steps for i in s["indices"]]
        assert len(seen) == len(set(seen)) == 5 * B  # every step B samples, none twice
    windows = results[0]["windows"]
    assert [w["may_leave_out"] for w in windows] == [True] * 3
    assert windows[1]["left_out"] == [last] and windows[1]["batches"][last] == results[0]["probe_batch"]
    said = [line for line in run.stdout.splitlines() if line.startswith("hvd_balance: rank")]
    assert said == [f"hvd_balance: rank {last} left out from epoch 1: without them 1.0 ms "
                    f"predicted; they held {round(100 / nproc)} % of the samples",
                    f"hvd_balance: rank {last} taken back from epoch 2: without them a step takes "
                    + said[1].split("takes ")[1]], said


def test_the_controller_leaves_a_costly_rank_out_and_every_rank_ends_equal(tmp_path):
    """Rank 1 sleeps 0.15 s a step in epochs 0 and 1: left out from epoch 1, the epochs run at
    rank 0's own speed; both ranks end with the same weights. The run record says so."""
    run = run_torchrun(SCRIPTS + "leave_out_live.py", nproc=2, timeout=150,
                       env={run_records.ENV: str(tmp_path / "run.jsonl")})
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert results[0]["plans"] == results[1]["plans"]
    plans, epoch_s = results[0]["plans"], results[0]["epoch_s"]
    assert plans[0] == [32, 32] and plans[1] == [64, 0], plans
    assert max(epoch_s[1:3]) < epoch_s[0] / 3, epoch_s
    assert results[0]["differs"] == results[1]["differs"] == 0.0
    assert "hvd_balance: rank 1 left out from epoch 1: with them a step takes " in run.stdout
    windows = run_records.windows_of(tmp_path / "run.jsonl", "torch", 2, 64)
    assert [(w["epoch"], w["step"], [r["local_batch"] for r in w["ranks"]], w["step_ms"],
             w["decision"], w["predicted_ms"]) for w in windows] == \
        [(h["epoch"], h["step"], h["batch_sizes"], h["step_ms"], h["decision"], h["predicted_ms"])
         for h in results[0]["history"]]  # the file holds the balancer's history
    out = [w for w in windows if w["left_out"] == [1]]
    assert out and all(w["ranks"][1]["samples_per_s"] is None for w in out), windows
    assert all(w["share_of_ideal"] > 0 for w in windows if w["step_ms"]), windows
    summary = run_records.drawn(tmp_path / "run.jsonl", tmp_path / "report.png")
    assert f"rank 1 was left out for {len(out)} of {len(windows)} windows" in summary, summary


def test_a_given_plan_that_leaves_a_rank_out_is_refused_naming_it(tmp_path):
    """Every rank starts (DDP's first steps run collectives of its own on every rank)."""
    path = tmp_path / "plan.yaml"
    Plan.from_batch_sizes([64, 0]).save(str(path))
    run = run_torchrun(SCRIPTS + "train.py", nproc=2, timeout=120, args=["plan", path])
    results = run.results()
    for rank in (0, 1):
        assert "the plan leaves rank(s) [1] out: launch the job without them, or start with " \
            "every rank" in results[rank]["error"], results[rank]


@pytest.mark.parametrize("leaver, when, syncbn, at", [
    (0, "mid", False, (1, 3)), (1, "mid", True, (1, 3)), (0, "last", True, (1, 4)),
    (0, "before", True, (1, 0)), (2, "probe_stop", False, (1, 0)),
    (2, "probe_break", False, (1, 0)), (2, "after_probe", False, (2, 0)),
    (0, "top", False, (1, 0))])
def test_a_rank_leaving_while_one_is_out_stops_every_rank_at_once(leaver, when, syncbn, at):
    """Rank 2 is out in epoch 1 (``after_probe``: taken back for epoch 2); rank ``leaver``
    leaves its loop (leave_out_stop.py's WHEN). The ranks that train finish the step they are
    in over their own group, every rank out of its loop joins one gather that the rank out
    meets in its epoch's window, and every rank names the same leave within seconds, its
    loop ending on ``balancer.stopped`` (no Gloo timeout)."""
    run = run_torchrun(SCRIPTS + "leave_out_stop.py", nproc=3, timeout=60,
                       args=[str(leaver), when] + (["syncbn"] if syncbn else []))
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert sorted(results) == [0, 1, 2]
    why = "no reason given: a break out of the loop" if when == "probe_break" else "loss is nan"
    first = {"rank": leaver, "epoch": at[0], "step": at[1], "steps": 5, "why": why}
    for rank, r in results.items():
        assert r["stopped"] == first, (rank, r)
        assert r["seconds"] < 20, (rank, r["seconds"])
        assert r["steps"][0] == 5 and (rank != 2 or r["steps"][1] <= 1)  # its probe step
    said = f"hvd_balance: rank {leaver} left its training loop in epoch {at[0]} after {at[1]}"
    assert run.stdout.count(said) == 3, run.stdout[-3000:]


def test_a_look_at_a_batch_on_a_rank_left_out_is_no_leave():
    """``next(iter(loader))`` on rank 2, out in epoch 1, before its loop: no rank stops."""
    run = run_torchrun(SCRIPTS + "leave_out_stop.py", nproc=3, timeout=60, args=["2", "peek"])
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert [results[r]["stopped"] for r in range(3)] == [None] * 3
    assert [results[r]["steps"] for r in range(3)] == [[5, 5, 5], [5, 5, 5], [5, 1, 1]]
    assert "left its training loop" not in run.stdout


def test_stateful_objects_without_a_state_dict_are_refused_naming_their_type():
    import torch

    import hvd_balance.torch as hb

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="stateful= takes objects with state_dict\\(\\) and "
                                        "load_state_dict\\(\\); got function"):
        hb.LoadBalancer(model, hb.BalancedBatchSampler(8, 4), optimizer=opt,
                        stateful=[torch.optim.lr_scheduler.LambdaLR(opt, abs), lambda: 0])

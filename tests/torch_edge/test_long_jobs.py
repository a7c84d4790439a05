"""What a job of hours meets on the torch edges: a rank that goes silent, a long pause, a rank
left out for an epoch longer than the group's timeout, the loop's own collectives while a rank
is out. Ranks under torchrun (hard timeout); ``$HVD_BALANCE_LOST_S`` a few seconds."""

import re
import time

import pytest

from support.torchrun import run_torchrun

SCRIPTS = "tests/torch_edge/rank_scripts/"
LOST_S = 3


def silent_job(nproc, mode, lightning=False):
    started = time.time()
    run = run_torchrun(SCRIPTS + "silent_rank.py", nproc=nproc, timeout=90,
                       env={"HVD_BALANCE_LOST_S": str(LOST_S)},
                       args=[mode] + (["lightning"] if lightning else []))
    return run, started, time.time()


@pytest.mark.parametrize("nproc, lightning", [  # 2 ranks, and Lightning's: in the long runs
    pytest.param(2, False, marks=pytest.mark.slow), (3, False),
    pytest.param(2, True, marks=pytest.mark.slow)])
def test_a_frozen_rank_ends_every_other_rank_naming_it(nproc, lightning):
    """Rank 1 is stopped with SIGSTOP mid-epoch: every other rank prints rank 1, its host and
    its silence, and exits non-zero within lost_s and a beat (the first to see it tells the
    others, before torchrun's SIGTERM); torchrun reports the job failed."""
    run, _, ended = silent_job(nproc, "freeze", lightning)
    assert run.returncode != 0, run.stdout[-3000:]
    frozen = float(re.search(r"FROZEN rank 1 at ([\d.]+)", run.stdout).group(1))
    said = re.findall(r"hvd_balance: rank (\d+) \(\S+, pid \d+\) stops: rank 1 on (\S+) "
                      r"\(pid \d+\) has been silent for (\d+) s", run.stdout)
    assert sorted(int(r) for r, _, _ in said) == [r for r in range(nproc) if r != 1], run.stdout[-3000:]
    # Silent lost_s for the first rank to see it; the others hear its word at once.
    assert all(host != "?" and LOST_S - 1 <= int(s) <= LOST_S + 2 for _, host, s in said), said
    assert ended - frozen < 3 * LOST_S + 15  # torchrun ends it once the frozen rank goes on
    assert "ChildFailedError" in run.stdout


@pytest.mark.parametrize("lightning", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_long_checkpoint_on_one_rank_is_no_silence(lightning):
    """Rank 0 writes a checkpoint for 3 lost_s while the others wait in a barrier: no rank
    stops, every rank trains every epoch."""
    run, _, _ = silent_job(2 if lightning else 3, "pause", lightning)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "has been silent" not in run.stdout
    assert {r["epochs"] for r in run.results().values()} == {3}


def test_a_rank_left_out_for_an_epoch_longer_than_the_group_timeout_waits_out_of_band():
    """init_process_group(timeout=3 s), epochs of about 4 s, the last rank out in epoch 1: it
    waits for the others' epoch end out of band, and the update stays exact (float64)."""
    run = run_torchrun(SCRIPTS + "leave_out_exact.py", nproc=3, timeout=120,
                       env={"TEST_PG_TIMEOUT_S": "3"}, args=["slow"])
    assert run.returncode == 0, run.stdout[-3000:]
    results = run.results()
    assert all(r["relative"] < 1e-9 for r in results.values()), results
    assert results[0]["epoch_s"][1] > 3.5, results[0]["epoch_s"]  # longer than the timeout
    assert [h for h in results[0]["history"]][1][2] == 0  # rank 2 was out in epoch 1


def test_a_per_batch_scheduler_not_in_stateful_is_refused_on_every_rank_before_a_leave():
    run = run_torchrun(SCRIPTS + "leave_out_exact.py", nproc=3, timeout=120, args=["nostateful"])
    results = run.results()
    assert sorted(results) == [0, 1, 2], run.stdout[-3000:]
    for r in results.values():
        assert "LambdaLR steps every batch but is not in LoadBalancer(stateful=)" in r["error"], r


@pytest.mark.parametrize("how", ["default", "training_group"])
def test_the_loops_own_collective_while_a_rank_is_out(how):
    """A dist.all_reduce of the loss after each step, rank 2 out in epoch 1: on the default
    group every rank ends at once, non-zero, naming the call and the fix (its own error, or
    the stop note of a rank that raised it); on hb.training_group() it sums over the ranks
    that train and the job trains to the end."""
    run = run_torchrun(SCRIPTS + "leave_out_exact.py", nproc=3, timeout=120,
                       args=["log_" + how])
    results = run.results()
    if how == "default":
        assert run.returncode != 0
        call = ("torch.distributed.all_reduce on the default group in the middle of an epoch "
                "while rank(s) [2] are left out of its steps")
        failed = [r for r in results.values() if "error" in r]
        assert failed and all(call in r["error"] and "LeftOutError" in r["error"]
                              and "group=hvd_balance.torch.training_group()" in r["error"]
                              for r in failed), run.stdout[-3000:]
        said = re.findall(r"hvd_balance: rank \d left its training loop in epoch 1 after 0 of "
                          r"its 5 steps \((.*?)\); every rank stops there .*?\[rank (\d)\]",
                          run.stdout)
        # Every rank raised it itself, or stopped there on another's word, saying why.
        told = {r["rank"] for r in failed} | {int(r) for _, r in said}
        assert told == {0, 1, 2}, run.stdout[-3000:]
        assert all(call in why for why, _ in said)
        return
    assert run.returncode == 0, run.stdout[-3000:]
    for r in results.values():
        assert r["relative"] < 1e-9
        # Each logged sum is over the samples of the ranks that train: B a step, every step.
        assert set(r["logged_counts"]) == {r["B"]}, r["logged_counts"]

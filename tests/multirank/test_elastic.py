"""Elastic Horovod (``hvd.elastic.run`` with hvd_balance.elastic) on local workers.

The workers log the ids of the samples each training step really held (recorded inside the
compiled step), and the tests audit the logs: after a worker leaves (removed by the host
discovery script), joins (added by it) or dies (SIGKILL in the middle of a segment), the
plan is recomputed for
the new world size, training goes on from the last commit, every sample is committed
exactly once per epoch (none twice, none skipped), the steps run after the last commit are
undone and run again, and the survivors end with identical weights.
"""
import json
import os
import socket
import stat
from collections import Counter

import pytest

from support import run_ranks

SCRIPT = "tests/rank_scripts/elastic_fit.py"
N, B, SEGMENT, EPOCHS = 1536, 48, 4, 3
STEPS = N // B


def discovery(tmp_path, before, after=None):
    """A host discovery script printing ``before`` until ``OUT/marker`` exists, then ``after``."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "discover.sh"
    after = before if after is None else after
    script.write_text(f"#!/bin/sh\nif [ -e {out}/marker ]; then\n"
                      f"printf '{after}\\n'\nelse\nprintf '{before}\\n'\nfi\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return out, script


def run_elastic(out, script, np, min_np, max_np, args, timeout=240, launcher_args=()):
    return run_ranks(SCRIPT, np=np, args=[out, EPOCHS, *args], timeout=timeout, launcher_args=[
        "--min-np", min_np, "--max-np", max_np, "--network-interface", "lo",
        "--host-discovery-script", script, *launcher_args])


def read_logs(out):
    """Every worker process's records, in order: lists of (kind, fields)."""
    workers = []
    for name in sorted(os.listdir(out)):
        if name.startswith("worker-"):
            with open(out / name) as f:
                workers.append([line.split(" ", 1) for line in f.read().splitlines()])
    return workers


def generations(worker):
    """This worker's (entry, size, resume (epoch, step), plan, trained records) per entry."""
    gens = []
    for kind, rest in worker:
        if kind == "ENTRY":
            gens.append({"size": int(rest.split()[2]), "resume": None, "plan": None, "trained": []})
        elif kind == "FIT" and gens[-1]["resume"] is None:
            _, epoch, step, size, plan = rest.split(" ", 4)
            gens[-1].update(resume=(int(epoch), int(step)), plan=json.loads(plan))
            assert int(size) == gens[-1]["size"]
        elif kind == "TRAINED":
            _, epoch, step, ids = rest.split(" ", 3)
            gens[-1]["trained"].append(((int(epoch), int(step)), json.loads(ids)))
    return gens


def audit(out):
    """Checks the logs; returns (timeline [(resume, size, plan)], committed steps, undone steps)."""
    workers = read_logs(out)
    finished = [w for w in workers if w and w[-1][0] == "DONE"]
    assert finished, "no worker finished"
    first = max(finished, key=lambda w: len(generations(w)))  # one that ran from the start
    timeline = [(g["resume"], g["size"], g["plan"]) for g in generations(first)]
    # every finished worker saw the same resets since it started, and the same plans
    for w in finished:
        seen = [(g["resume"], g["size"], g["plan"]) for g in generations(w)]
        assert seen == timeline[len(timeline) - len(seen):]
    bounds = {(t[0], t[1]): (timeline[i + 1][0] if i + 1 < len(timeline) else (EPOCHS, 0))
              for i, t in enumerate(timeline)}
    committed = {}  # (epoch, step) -> [ids of each rank]
    undone = 0
    for w in workers:
        for g in generations(w):
            end = bounds[(g["resume"], g["size"])]
            for position, ids in g["trained"]:
                assert g["resume"] <= position
                if position < end:
                    committed.setdefault(position, []).append(ids)
                else:
                    undone += 1
    # Every step of every epoch committed once, by as many ranks as the world had then,
    # with B samples; every sample committed exactly once per epoch.
    assert sorted(committed) == [(e, s) for e in range(EPOCHS) for s in range(STEPS)]
    for epoch in range(EPOCHS):
        counts = Counter()
        for step in range(STEPS):
            batches = committed[(epoch, step)]
            size = next(t[1] for t in reversed(timeline) if t[0] <= (epoch, step))
            assert len(batches) == size, (epoch, step, len(batches), size)
            assert sum(len(b) for b in batches) == B
            counts.update(i for b in batches for i in b)
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}, epoch
    checksums = {w[-1][1].split()[2] for w in finished}
    assert len(checksums) == 1, checksums  # the survivors hold the same weights
    return timeline, committed, undone


def assert_replanned(timeline, sizes):
    assert [t[1] for t in timeline] == sizes
    for resume, size, plan in timeline:
        assert len(plan["batch_sizes"]) == size and sum(plan["batch_sizes"]) == B
        assert plan["method"] == "minmax" and len(plan["curves"]) == size  # benchmarked anew
    # each reset resumes at a commit: a segment boundary
    assert all(resume[1] % SEGMENT == 0 for resume, _, _ in timeline)


@pytest.mark.timeout(300)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_a_worker_removed_by_discovery_leaves_and_training_resumes_exactly(tmp_path):
    out, script = discovery(tmp_path, "localhost:3", "localhost:2")
    run = run_elastic(out, script, 3, 2, 3, ["6"])  # rank 0 makes the marker at commit 6
    assert run.returncode == 0, run.stdout[-4000:]
    timeline, committed, undone = audit(out)
    assert_replanned(timeline, [3, 2])
    assert timeline[1][0] > (0, 6 * SEGMENT - 1)  # the reset came after the marker
    assert undone == 0  # a removal is handled at a commit: nothing to undo
    assert "hvd_balance: 2 ranks, resuming at epoch" in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_added_by_discovery_joins_with_the_committed_state(tmp_path):
    out, script = discovery(tmp_path, "localhost:2", "localhost:3")
    run = run_elastic(out, script, 2, 2, 3, ["6"])
    assert run.returncode == 0, run.stdout[-4000:]
    timeline, committed, undone = audit(out)
    assert_replanned(timeline, [2, 3])
    assert undone == 0
    joined = [w for w in read_logs(out) if w[0] == ["ENTRY", "1 2 3"]]
    assert len(joined) == 1  # the new worker started at the reset, as rank 2 of 3
    assert generations(joined[0])[0]["resume"] == timeline[1][0]  # from the committed state


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_that_dies_mid_segment_is_dropped_and_its_work_redone(tmp_path):
    # Two host names for this machine, so that Horovod blacklists only the dead worker's.
    other = socket.gethostname()
    assert other != "localhost"
    out, script = discovery(tmp_path, f"localhost:2\\n{other}:1")
    run = run_elastic(out, script, 3, 2, 3, ["6", other], launcher_args=["--gloo-timeout-seconds", "15"])
    assert run.returncode == 0, run.stdout[-4000:]
    timeline, committed, undone = audit(out)
    assert_replanned(timeline, [3, 2])
    killed = [rest for w in read_logs(out) for kind, rest in w if kind == "KILLED"]
    assert len(killed) == 1
    epoch, step = map(int, killed[0].split())
    assert timeline[1][0] == (epoch, step - step % SEGMENT)  # back to the last commit
    assert undone >= 2 * (step % SEGMENT + 1)  # the uncommitted steps of every rank, redone

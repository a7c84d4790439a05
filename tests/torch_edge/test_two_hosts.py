"""The torch edge across two hosts of the namespace cluster (root), a rank on each under
torchrun's c10d rendezvous: a cut link ends the job on both sides naming the other, and a
stranger on a third host flooding the ranks' UDP ports neither reaches a rank nor holds up
a stop note."""

import json
import re
import sys
import threading
import time
import uuid

import pytest

from hvd_balance.tools import netns_cluster
from support.cluster import run_on, skip_reason
from support.launch import PYTHON, REPO

SCRIPT = REPO / "tests" / "torch_edge" / "rank_scripts" / "two_hosts.py"
LOST_S = 5


@pytest.fixture(scope="module")
def cluster():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with netns_cluster.NetnsCluster(["hostA", "hostB", "hostC"]) as c:
        yield c
    assert netns_cluster.leftovers(c.run_id) == []


def start_job(cluster, mode, folder, timeout=150):
    """torchrun on hostA and hostB (one rank each) in threads; returns them and their runs."""
    endpoint = f"{cluster.host('hostA').address}:29400"
    runs, rdzv = {}, uuid.uuid4().hex[:8]

    def on(host):
        runs[host] = run_on(cluster, host, [
            PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv}",
            "--monitor-interval=0.5", SCRIPT, mode, folder], timeout=timeout,
            env={"GLOO_SOCKET_IFNAME": "eth0", "HVD_BALANCE_LOST_S": str(LOST_S)})

    threads = [threading.Thread(target=on, args=(h,)) for h in ("hostA", "hostB")]
    for t in threads:
        t.start()
    return threads, runs


def wait_for(path, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.1)


def exited(pid):
    """Whether process ``pid`` has ended (gone, or a zombie its launcher has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.timeout(240)
def test_a_cut_link_ends_both_ranks_naming_the_other(cluster, tmp_path):
    threads, runs = start_job(cluster, "cut", tmp_path)
    for name in ("ready", "pid0", "pid1"):
        wait_for(tmp_path / name)
    pids = {r: int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)}
    cut, ended = time.monotonic(), {}
    cluster.set_link_up("hostB", False)
    try:
        while len(ended) < 2 and time.monotonic() - cut < 90:
            ended.update({r: time.monotonic() - cut for r, p in pids.items()
                          if r not in ended and exited(p)})
            time.sleep(0.1)
    finally:
        # torchrun's agent on hostB reports the failure to the rendezvous store on hostA.
        cluster.set_link_up("hostB", True)
    for t in threads:
        t.join(200)
    assert sorted(ended) == [0, 1] and max(ended.values()) < 60, \
        (ended, {h: r.stdout[-2000:] for h, r in runs.items()})
    for host, me, other, where in (("hostA", 0, 1, "hostB"), ("hostB", 1, 0, "hostA")):
        out = runs[host].stdout
        assert runs[host].returncode != 0, out[-3000:]
        assert re.search(rf"hvd_balance: rank {me} \({host}, pid \d+\) stops: rank {other} on "
                         rf"{where} \(pid \d+\) has been silent for \d+ s", out), out[-3000:]
        assert not runs[host].leftovers, out[-3000:]
    print(json.dumps({"rank_exit_s_after_cut": ended}), file=sys.stderr)


@pytest.mark.timeout(240)
def test_a_flood_from_a_third_host_reaches_no_rank_and_a_stop_note_gets_through(
        cluster, tmp_path):
    threads, runs = start_job(cluster, "flood", tmp_path)
    for rank in (0, 1):
        wait_for(tmp_path / f"ports{rank}.json")
    ports = [p for r in (0, 1) for p in json.loads((tmp_path / f"ports{r}.json").read_text())]
    (tmp_path / "flooding").write_text("")
    flood = cluster.run("hostC", [PYTHON, str(REPO / "tests" / "support" / "forge.py"),
                                  json.dumps(ports), "10"], cwd=str(REPO), timeout=60,
                        env={"PYTHONPATH": str(REPO)})
    for t in threads:
        t.join(200)
    assert flood.returncode == 0, flood.stdout
    sent = json.loads(flood.stdout.strip().splitlines()[-1])["sent"]
    results = {}
    for host in ("hostA", "hostB"):
        assert runs[host].returncode == 0, runs[host].stdout[-3000:]
        results.update(runs[host].results())
    assert sorted(results) == [0, 1] and sent > 10000, (results, sent)
    for r in results.values():
        assert r["transports"] == ["udp"] and r["dropped"] == 0, r  # the kernel dropped them all
        assert r["stopped"]["why"] == "a test stops here" and r["stopped"]["rank"] == 1, r
    # Rank 0 stopped where rank 1 did, or after the step it was in.
    assert results[0]["steps"] - results[1]["steps"] in (0, 1), results
    print(json.dumps({"sent": sent, **{f"rank{r}": {k: v[k] for k in ("step_before_s",
                      "step_during_s")} for r, v in results.items()}}), file=sys.stderr)

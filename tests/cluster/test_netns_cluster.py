"""The namespace cluster itself: hosts answer ssh by name, quotas and link rates hold, and
nothing is left after a normal end, an exception, SIGTERM or SIGKILL of its owner."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hvd_balance.tools import netns_cluster
from hvd_balance.tools.netns_cluster import ClusterError, Link, NetnsCluster
from support import PYTHON, REPO

pytestmark = pytest.mark.cluster

# Sends MiB from one host to the other over TCP and prints the receiver's Mbit/s.
_SEND = """
import socket, sys, time
role, peer, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "recv":
    s = socket.create_server(("0.0.0.0", 5999)); c, _ = s.accept(); n = 0; t0 = None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        t0 = t0 or time.perf_counter(); n += len(b)
    print(f"MBIT {n * 8 / (time.perf_counter() - t0) / 1e6:.1f} BYTES {n}", flush=True)
else:
    for _ in range(100):
        try: c = socket.create_connection((peer, 5999)); break
        except OSError: time.sleep(0.05)
    chunk = b"x" * (1 << 20)
    for _ in range(mib): c.sendall(chunk)
    c.close()
"""


def _transfer_mbit(cluster, sender, receiver, mib):
    recv = subprocess.Popen(cluster.ssh_command(receiver, receiver, [PYTHON, "-c", _SEND, "recv", "-", "0"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    send = cluster.run(sender, [PYTHON, "-c", _SEND, "send", receiver, str(mib)], timeout=60)
    out, _ = recv.communicate(timeout=60)
    assert send.returncode == 0 and recv.returncode == 0, (send.stdout, out)
    fields = out.split()
    assert int(fields[fields.index("BYTES") + 1]) == mib << 20
    return float(fields[fields.index("MBIT") + 1])


def test_hosts_answer_ssh_under_their_names(cluster):
    for src in ("hostA", "hostB"):
        for dst in ("hostA", "hostB"):
            out = subprocess.run(cluster.ssh_command(src, dst, ["sh", "-c", "hostname; getent hosts hostA hostB"]),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
            lines = out.stdout.split("\n")
            assert out.returncode == 0 and lines[0] == dst, out.stdout
            assert f"{cluster.host('hostA').address} hostA" in " ".join(out.stdout.split())
            assert f"{cluster.host('hostB').address} hostB" in " ".join(out.stdout.split())
    # Key login only: the run's key, not root's own.
    assert os.path.dirname(cluster.ssh_config) == cluster.workdir


def test_hosts_lists_a_running_cluster_for_other_processes(cluster):
    # What scripts/cluster/slurm.sh --netns reads instead of knowing the owner file's layout.
    out = subprocess.run([PYTHON, str(REPO / "scripts" / "cluster" / "netns-cluster"), "hosts",
                          "--run-id", cluster.run_id], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60)
    assert out.returncode == 0, out.stdout
    assert out.stdout.splitlines() == [f"{h.name} {h.address} {h.namespace}" for h in cluster.hosts]
    gone = subprocess.run([PYTHON, str(REPO / "scripts" / "cluster" / "netns-cluster"), "hosts",
                           "--run-id", "0badc0de"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    assert gone.returncode == 2 and "'0badc0de'" in gone.stdout, gone.stdout


def test_cpu_share_and_link_rate_hold(cluster_ready):
    with NetnsCluster(["hostA", "hostB"], cpu_shares=[None, 0.5],
                      links={"hostB": Link("200mbit")}) as c:
        out = c.run("hostB", ["cat", "/proc/self/cgroup"], timeout=30)
        group = f"{netns_cluster.CGROUP_PREFIX}{c.run_id}/rank1"
        assert out.returncode == 0 and group in out.stdout, out.stdout
        quota = [line for line in out.stdout.splitlines() if group in line][0]
        cpu_dir = [d for d in netns_cluster._cgroup_dirs(c.run_id)][0]
        with open(os.path.join(cpu_dir, "rank1", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(cpu_dir, "rank1", "cpu.cfs_period_us")) as f:
            assert quota_us == int(f.read()) // 2, quota
        # 200 Mbit/s out of hostB's link, either way; unshaped inside hostA it is far faster.
        for sender, receiver in (("hostB", "hostA"), ("hostA", "hostB")):
            mbit = _transfer_mbit(c, sender, receiver, 24)
            assert 120 < mbit < 215, (sender, receiver, mbit)
        assert _transfer_mbit(c, "hostA", "hostA", 24) > 600
    assert netns_cluster.leftovers(c.run_id) == []


def test_nothing_left_after_an_exception(cluster_ready):
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsCluster(["hostA"], cpu_shares=[0.5]) as c:
            sshd = c.host("hostA").sshd_pid
            assert netns_cluster.leftovers(c.run_id)
            raise RuntimeError("boom")
    assert netns_cluster.leftovers(c.run_id) == []
    assert not os.path.exists(f"/proc/{sshd}")


def test_bad_input_is_refused_naming_it(cluster_ready):
    with pytest.raises(ClusterError, match=r"host names \['a', 'a'\] repeat"):
        NetnsCluster(["a", "a"])
    with pytest.raises(ClusterError, match="links for unknown hosts \\['hostC'\\]"):
        NetnsCluster(["hostA"], links={"hostC": Link("1gbit")})
    with pytest.raises(ClusterError, match="'fast' is neither a rate"):
        Link.parse("fast")
    with pytest.raises(ClusterError, match="host name 'a_b'"):
        NetnsCluster(["a_b"])


def _start_cli(run_id):
    proc = subprocess.Popen([PYTHON, str(REPO / "scripts" / "cluster" / "netns-cluster"), "up",
                             "--hosts", "hostA,hostB", "--cpu-shares=-,0.5", "--run-id", run_id],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == "ready":
            break
    assert lines and lines[-1].strip() == "ready", "".join(lines)
    text = "".join(lines)
    sshd = [int(w) for line in lines if " sshd " in line
            for w in [line.split(" sshd ")[1].split(",")[0]]]
    assert len(sshd) == 2 and all(os.path.exists(f"/proc/{p}") for p in sshd), text
    assert len(netns_cluster.leftovers(run_id)) >= 6, netns_cluster.leftovers(run_id)
    return proc, sshd


@pytest.mark.timeout(120)
def test_sigterm_of_the_owner_removes_everything(cluster_ready):
    run_id = os.urandom(4).hex()
    proc, sshd = _start_cli(run_id)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and f"cluster {run_id} removed" in rest, rest
    assert netns_cluster.leftovers(run_id) == []
    assert not any(os.path.exists(f"/proc/{p}") for p in sshd)


@pytest.mark.timeout(120)
def test_sigkill_of_the_owner_leaves_what_the_next_run_removes(cluster_ready):
    run_id = os.urandom(4).hex()
    proc, sshd = _start_cli(run_id)
    proc.kill()
    proc.wait(30)
    left = netns_cluster.leftovers(run_id)
    assert any(item.startswith("namespace ") for item in left), left
    assert run_id in netns_cluster.run_ids() and not netns_cluster.owner_alive(run_id)
    # What the next cluster does first (NetnsCluster.start): remove the runs of dead owners.
    assert run_id in netns_cluster.teardown_stale()
    assert netns_cluster.leftovers(run_id) == []
    time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
                   for p in sshd)

#!/usr/bin/env python3
"""What a host's slower link does to Horovod's allreduce, on the namespace cluster.

    python scripts/cluster/link_allreduce.py [--rates unshaped,10gbit,1gbit,100mbit] [--mib 1,16]

Makes hostA and hostB (scripts/cluster/netns-cluster; root), runs one rank on each with
horovodrun over ssh, and for each rate given to hostB's link (tc, both directions; hostA's
stays unshaped) times a Sum allreduce of float32 tensors of each size (median of --repeats,
after a warm-up). Rank 0 reshapes the link between measurements, between two barriers.
Prints a table: rate, MiB, median ms, and the effective bus rate in Gbit/s (a 2-rank ring
moves the tensor once each way: bytes * 8 / time).
"""
import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def worker(args):
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from hvd_balance.tools import netns_cluster
    hvd.init()
    cluster = netns_cluster.attach(args.run_id) if hvd.rank() == 0 else None
    rows = []
    for rate in args.rates.split(","):
        hvd.allreduce(tf.constant(0.0), name="before_shape")
        if cluster is not None:
            cluster.shape("hostB", None if rate == "unshaped" else netns_cluster.Link(rate))
        hvd.allreduce(tf.constant(0.0), name="after_shape")
        for mib in (int(m) for m in args.mib.split(",")):
            x = tf.ones([mib * 262144], tf.float32)
            hvd.allreduce(x, op=hvd.Sum, name=f"warm_{rate}_{mib}").numpy()
            times = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                hvd.allreduce(x, op=hvd.Sum, name=f"t_{rate}_{mib}_{r}").numpy()
                times.append(time.perf_counter() - t0)
            ms = float(np.median(times)) * 1e3
            rows.append((rate, mib, ms, mib * 2**20 * 8 / (ms / 1e3) / 1e9))
    if hvd.rank() == 0:
        print("hostB link  MiB  allreduce ms  Gbit/s")
        for rate, mib, ms, gbit in rows:
            print(f"{rate:>10}  {mib:3d}  {ms:12.1f}  {gbit:6.2f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="unshaped,10gbit,1gbit,100mbit")
    p.add_argument("--mib", default="1,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-id", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from hvd_balance.tools.netns_cluster import NetnsCluster
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = {k: v for k, v in os.environ.items()}
    env.update(PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    with NetnsCluster(["hostA", "hostB"]) as c:
        cmd = [horovodrun, "-np", "2", "-H", "hostA:1,hostB:1", "--gloo", sys.executable,
               os.path.abspath(__file__), "--worker", "--run-id", c.run_id,
               "--rates", args.rates, "--mib", args.mib, "--repeats", str(args.repeats)]
        return subprocess.call(c.ssh_command("hostA", "hostA", cmd, env, cwd=REPO))


if __name__ == "__main__":
    sys.exit(main())

"""Whether the plans' difference predicts a paired job's median, and how even each plan's
busy times were: per paired job of the files given, the half core's (rank 1's) and the
quarter cores' (ranks 2-3) batches under the default's plan minus the paper's (samples), the
job's median pair ratio (paper / default step), and per plan the slowest rank's busy time over
the fastest's and the slowest's busy ms (medians over the plan's compared epochs but each
epoch's first step); then the rank correlation (Spearman) of each difference with the median
over the jobs, with a permutation p-value (10,000 shuffles, seed 0). Control jobs are left out.

Usage: python docs/bench/first_steps/plans_and_ratios.py FILE.json[.gz] ...
"""
import gzip
import json
import statistics as st
import sys

import numpy as np

from hvd_balance.tools.bench.figures import slot_epochs


def load(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def ranks(x):
    """Ranks 0..n-1, ties given their mean rank."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r


def spearman(x, y, shuffles=10_000):
    rx, ry = ranks(x), ranks(y)
    rho = float(np.corrcoef(rx, ry)[0, 1])
    rng = np.random.default_rng(0)
    null = np.array([np.corrcoef(rx, rng.permutation(ry))[0, 1] for _ in range(shuffles)])
    return rho, float(np.mean(np.abs(null) >= abs(rho)))


half, quarters, medians = [], [], []
for path in sys.argv[1:]:
    for job in load(path)["jobs"]:
        if job["strategy"] != "paired":
            continue
        r, p = job["result"], job["result"]["paired"]
        spread = {}
        for name in ("default", "paper"):
            busy = [st.median([t for e in slot_epochs(p, name) for t in rank["busy_s"][e][1:]]) for rank in r["ranks"]]
            spread[name] = f"{max(busy) / min(busy):.3f} (slowest {1e3 * max(busy):.0f} ms)"
        half.append(p["default"][1] - p["paper"][1])
        quarters.append(sum(p["default"][2:]) - sum(p["paper"][2:]))
        medians.append(st.median(job["summary"]["paired"]["pair_ratios"]))
        print(f"{path.split('/')[-1]} rep {job['rep']}: paper {p['paper']}, default {p['default']}, "
              f"half core {half[-1]:+d}, quarter cores {quarters[-1]:+d}, median {medians[-1]:.3f}; "
              f"busy slowest / fastest: default {spread['default']}, paper {spread['paper']}")
for name, diff in (("half core", half), ("quarter cores", quarters)):
    if len(diff) > 2:
        rho, pvalue = spearman(diff, medians)
        print(f"{name}: Spearman {rho:.2f} over {len(diff)} jobs, permutation p = {pvalue:.2f}")

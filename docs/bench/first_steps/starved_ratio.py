"""For every epoch-end round of the paired jobs' default LoadBalancer: the largest CPU load
(CPU seconds per wall second over the rank's allowance) and that rank's step less its wait for
busier ranks over its busy time, ``(busy_i + step - max_j busy_j) / busy_i``, which
``hvd_balance.core.replan.starved_rank`` compares with ``STARVED_WAIT``.

Usage: python docs/bench/first_steps/starved_ratio.py FILE.json[.gz] ...
Prints per file "load/ratio" for each round that timed every rank.
"""
import gzip
import json
import sys

for path in sys.argv[1:]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        jobs = json.load(f)["jobs"]
    out = []
    for job in jobs:
        for h in job["result"]["replans"]:
            load = h.get("cpu_load") or [None]
            if h["step"] != 0 or not h["step_ms"] or None in h["busy_ms"] or None in load:
                continue
            i = max(range(len(load)), key=lambda k: load[k])
            busy = h["busy_ms"]
            out.append(f"{load[i]:.2f}/{(busy[i] + h['step_ms'] - max(busy)) / busy[i]:.2f}")
    print(path.split("/")[-1], " ".join(out))

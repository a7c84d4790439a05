"""The side-by-side benchmark's JSON as BENCHMARKS.md's job tables: one markdown row per job
(final local batches, epoch seconds, steady epoch seconds, balance efficiency, start cost s,
job s, other processes' cores, and the rounds that changed the plan), then per file the
summary's ``proportional / balanced epoch time`` (median over repetitions of the paper's
steady epoch over the default's; above 1: the default is faster) with each repetition's.

Usage: python docs/bench/first_steps/jobs_table.py FILE.json[.gz] ...
"""
import gzip
import json
import sys


def load(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def rounds(result):
    """``eN sM: batches (what)`` for each round that changed the plan."""
    out = []
    for r in result.get("replans") or []:
        if not r["changed"]:
            continue
        what = ("undone" if r["reverted"] else "paper's plan" if r["explored"] else
                "offload" if r.get("offloaded") else "benchmarked" if r.get("benchmarked") else
                f"{100 * r['gain']:.1f} % predicted, thr {100 * r['threshold']:.0f} %")
        out.append(f"e{r['epoch']} s{r['step']}: {'/'.join(map(str, r['batch_sizes']))} ({what})")
    return "; ".join(out) or "-"


for path in sys.argv[1:]:
    d = load(path)
    print(f"{path.split('/')[-1]}: {d['command']}")
    for j in d["jobs"]:
        s = j["summary"]
        print(f"|  | {j['strategy']} | {j['rep']} | {', '.join(map(str, s['local_batches']))} | "
              f"{', '.join(f'{e:.2f}' for e in s['epoch_s'])} | {s['steady_epoch_s']:.3f} | "
              f"{s['efficiency']:.3f} | {s['start_cost_s']:.2f} | {s['run_s']:.1f} | "
              f"{j['others_cores']:.2f} | {rounds(j['result'])} |")
    v = d.get("balanced_vs_proportional")
    if v:
        print(f"proportional / balanced epoch time: {v['epoch_time_ratio']:.3f}, per repetition",
              [round(x, 3) for x in v["per_rep"]])
    for name, t in d.get("targets", {}).items():
        print(f"target {name}: {t['value']:.3f} {'met' if t['met'] else 'MISSED'}")

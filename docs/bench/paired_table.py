"""Every figure of the paired benchmark's JSON: the summary line with its 95 % interval, and
per job the two plans, the pairs and their median, each compared epoch's step, and each
plan's step, busy and wait (ms, medians over the plan's compared epochs but each epoch's
first step, per rank).

Usage: python docs/bench/paired_table.py FILE.json[.gz] ...
       python docs/bench/paired_table.py --pooled FILE.json[.gz] ...
(--pooled: one line per configuration, the name before "_paired_", over every pair of its
files.) A file whose jobs include the control strategy (the A/A test: the paper's plan in both
slots) gets a second line, "control (A/A)", over the control's pairs.
"""
import gzip
import json
import statistics as st
import sys

from hvd_balance.tools.bench.figures import median_interval, slot_epochs
from hvd_balance.tools.bench.settings import PAIRED_LABELS, PAIRED_STRATEGIES


def load(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def line(name, ratios, strategy="paired"):
    iv = median_interval(ratios)
    return (f"{name} {PAIRED_LABELS[strategy]} step time: {st.median(ratios):.3f} ({len(ratios)} "
            f"pairs, {sum(r > 1 for r in ratios)} above 1, 95 % interval "
            + (f"{iv['low']:.3f}-{iv['high']:.3f})" if iv else "none: too few pairs)"))


def ratios_of(d, strategy="paired"):
    return [x for p in (d.get(strategy) or {}).get("pair_ratios_per_rep", []) for x in p]


if sys.argv[1] == "--pooled":
    pooled = {}
    for path in sys.argv[2:]:
        d, name = load(path), path.split("/")[-1].split("_paired_")[0]
        for strategy in PAIRED_STRATEGIES:
            pooled.setdefault((name, strategy), []).extend(ratios_of(d, strategy))
    for (name, strategy), ratios in pooled.items():
        if ratios:
            print(line(name, ratios, strategy))
    sys.exit(0)

for path in sys.argv[1:]:
    d = load(path)
    for strategy in PAIRED_STRATEGIES:
        if ratios_of(d, strategy):
            print(line(path.split("/")[-1], ratios_of(d, strategy), strategy))
    for j in d["jobs"]:
        r = j["result"]
        p, first = r["paired"], r["paired"]["first_compared"]
        found = f" (the control: the default found {p['found']})" if p.get("control") else ""
        print(f"  rep {j['rep']} {j['strategy']}{found}: paper {p['paper']}, default {p['default']}, settled {p['settled']} "
              f"after {first - 1} epochs; pairs",
              [round(x, 3) for x in j["summary"]["paired"]["pair_ratios"]],
              f"(median {st.median(j['summary']['paired']['pair_ratios']):.3f})")
        print("    the default's rounds (epoch/step: batches, step ms, what it did):",
              "; ".join(f"{h['epoch']}/{h['step']}: {h['batch_sizes']}, "
                        f"{h['step_ms'] or 0:.0f}, {h.get('decision') or '-'}"
                        for h in r["replans"]))
        c = j["summary"]["paired"]  # figures.paired_comparison: each compared epoch's step
        print("    each compared epoch's step, ms: default",
              [round(1e3 * t) for t in c["default_step_s"]], "paper", [round(1e3 * t) for t in c["paper_step_s"]])
        for name in ("default", "paper"):
            es = slot_epochs(p, name)

            def med(key, rank):
                return round(1e3 * st.median([t for e in es for t in rank[key][e][1:]]))

            rank0 = r["ranks"][0]
            step = st.median([b + w for e in es
                              for b, w in zip(rank0["busy_s"][e][1:], rank0["wait_s"][e][1:])])
            print(f"    {name:8s} step {1e3 * step:.0f} ms, busy", [med("busy_s", rk) for rk in r["ranks"]],
                  "wait", [med("wait_s", rk) for rk in r["ranks"]])

"""Per plan of a sweep (sweep.py's JSON): the median over its epochs of rank 0's step (busy +
wait, ms, each epoch's first step left out), each rank's busy and wait (ms), and each rank's
CPU seconds per wall second over the epoch (its share of a core actually used); where the
file has them, each rank's CPU milliseconds per step by thread name (the 6 largest).

Usage: python docs/bench/resnet_plans/table.py SWEEP.json
"""
import json
import statistics as st
import sys

epochs = json.load(open(sys.argv[1]))
plans = []
for e in epochs:
    if e["plan"] not in plans:
        plans.append(e["plan"])
print("epoch steps (ms), in the order run:",
      [round(1e3 * st.median([b + w for b, w in zip(e["busy_s"][0][1:], e["wait_s"][0][1:])]))
       for e in epochs])
for plan in plans:
    es = [e for e in epochs if e["plan"] == plan]
    n = len(plan)
    step = st.median([st.median([b + w for b, w in zip(e["busy_s"][0][1:], e["wait_s"][0][1:])])
                      for e in es])

    def med(key, i):
        return round(1e3 * st.median([t for e in es for t in e[key][i][1:]]))

    print(f"{str(plan):22s} step {1e3 * step:4.0f}  busy {[med('busy_s', i) for i in range(n)]}"
          f"  wait {[med('wait_s', i) for i in range(n)]}"
          f"  cpu/wall {[round(st.median([e['cpu_s'][i] / e['wall_s'][i] for e in es]), 2) for i in range(n)]}")
    if "thread_cpu_s" in es[0]:
        for i in range(n):
            names = {}
            for e in es:
                for name, cpu in e["thread_cpu_s"][i].items():
                    names.setdefault(name, []).append(1e3 * cpu / len(e["busy_s"][i]))
            top = sorted(((st.median(v), k) for k, v in names.items()), reverse=True)[:6]
            print(f"    rank {i} CPU ms/step by thread:", ", ".join(f"{k} {v:.0f}" for v, k in top))

"""The device check's CPU part: ranks pinned to disjoint core sets of different sizes.

Run by ``scripts/device_check.sh --part cpu`` (``scripts/device_check.py``). For each
configuration (cores per rank, e.g. ``1,2,4,8``) one process per rank starts; rank ``i`` is
pinned to its own cores (``os.sched_setaffinity``) and runs as many threads
(``torch.set_num_threads``). So the ranks differ in speed for real: their compute and their
share of every collective run on their own cores, as on nodes of different sizes. One Gloo
group, the check's ResNet-style CNN on synthetic 32x32 images, torch's per-rank BatchNorm.

Per configuration:

- *solo*: each rank's samples/s alone on its cores at the local batch of equal batches (all
  ranks at once: their cores are disjoint, no collective);
- *ideal*: the sum of the solo rates, samples/s; the ideal speedup is that sum over the
  fastest rank's rate;
- equal batches (plain DDP's split), the paper's rule (batches proportional to the solo
  rates) and the LoadBalancer (equal start, re-planning every few steps), interleaved over
  ``repeats`` rounds: samples/s of the last epoch of each run (medians, with the range);
- *share of ideal*: a strategy's samples/s over the ideal; *efficiency*: the mean over ranks
  of busy seconds per step second in the LoadBalancer's last window (1: nobody waits);
  *start cost*: the LoadBalancer's first epoch's seconds beyond its last epoch's.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hvd_balance.torch as hb
from hvd_balance.core.plan import Plan
from hvd_balance.core.planner import plan_batches

import device_check_jobs as check

STRATEGIES = ("equal", "paper", "load_balancer")


def core_sets(cores_per_rank: Sequence[int], available: Sequence[int]) -> List[List[int]]:
    """Disjoint, consecutive sets of ``available`` cores of the given sizes, in rank order.

    Raises:
        ValueError: more cores asked for than available.
    """
    if sum(cores_per_rank) > len(available):
        raise ValueError(f"{sum(cores_per_rank)} cores asked for ({list(cores_per_rank)}), "
                         f"{len(available)} available")
    out, start = [], 0
    for n in cores_per_rank:
        out.append(list(available[start:start + n]))
        start += n
    return out


def summary(values: Sequence[float]) -> Dict[str, float]:
    """Median, lowest and highest of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def worker(rank: int, cfg: Dict, cores: List[List[int]], out: Dict) -> None:
    world = len(cores)
    os.sched_setaffinity(0, cores[rank])
    torch.set_num_threads(len(cores[rank]))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=check.GROUP_TIMEOUT_S))
    device = torch.device("cpu")
    B = cfg["global_batch"]
    equal = Plan.uniform(B, world)
    rate = check.measure_rate(device, cfg, equal.batch_sizes[rank])
    rates = [None] * world
    dist.all_gather_object(rates, rate)
    plans = {"equal": equal, "paper": plan_batches(rates, B, method="proportional"),
             "load_balancer": None}
    runs: Dict[str, List[Dict]] = {name: [] for name in STRATEGIES}
    for _ in range(cfg["repeats"]):  # interleaved: the machine's drift hits every strategy
        for name in STRATEGIES:
            balancing = name == "load_balancer"
            r = check.train(rank, device, cfg, plan=plans[name], sync_bn=False,
                            epochs=cfg["balancer_epochs"] if balancing else cfg["epochs"],
                            rebalance=cfg["rebalance_steps"] if balancing else "off")
            runs[name].append(r)
    if rank == 0:
        out.update(rates=rates, runs=runs)


def _child(rank, cfg, cores, path):
    out: Dict = {}
    worker(rank, cfg, cores, out)
    if rank == 0:
        Path(path).write_text(json.dumps(out, default=str))
    hb.end_job()  # torch 2.13's Gloo can abort a plain exit (SIGABRT), failing the spawn


def run_config(cores_per_rank: Sequence[int], cfg: Dict) -> Dict:
    """One configuration's ranks, trained and measured; what :func:`report` tabulates."""
    available = sorted(os.sched_getaffinity(0))
    cores = core_sets(cores_per_rank, available)
    cfg = dict(cfg, port=check.free_port())
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "rank0.json"
        mp.spawn(_child, args=(cfg, cores, str(path)), nprocs=len(cores), join=True)
        raw = json.loads(path.read_text())
    return dict(analyse(cores_per_rank, cfg, raw), wall_s=time.perf_counter() - start)


def analyse(cores_per_rank: Sequence[int], cfg: Dict, raw: Dict) -> Dict:
    """The table's numbers from rank 0's measurements (samples/s, shares, seconds)."""
    samples = cfg["steps"] * cfg["global_batch"]
    rates = raw["rates"]
    ideal = sum(rates)
    row = {"cores": list(cores_per_rank), "solo_samples_per_s": rates, "ideal_samples_per_s": ideal,
           "ideal_speedup": ideal / max(rates), "strategies": {}}
    for name in STRATEGIES:
        runs = raw["runs"][name]
        last = [samples / r["epoch_s"][-1] for r in runs]
        entry = {"samples_per_s": summary(last),
                 "share_of_ideal": summary([v / ideal for v in last]),
                 "plan": runs[-1].get("final_plan") or runs[-1]["plans"][-1]}
        if name == "load_balancer":
            entry["start_cost_s"] = summary([r["epoch_s"][0] - r["epoch_s"][-1] for r in runs])
            windows = [r["history"][-1] for r in runs if r.get("history")]
            entry["efficiency"] = summary([  # the ranks' mean busy share of the step
                sum(w["busy_ms"]) / len(w["busy_ms"]) / w["step_ms"] for w in windows
                if w["step_ms"] and None not in w["busy_ms"]] or [float("nan")])
        row["strategies"][name] = entry
    return row


def report(rows: List[Dict], cfg: Dict) -> List[str]:
    """Markdown lines: one table for every configuration."""
    lines = ["| cores per rank | solo samples/s | ideal speedup | strategy | samples/s (median, "
             "range) | share of ideal | plan |", "|---|---|---|---|---|---|---|"]
    labels = {"equal": "equal batches", "paper": "paper's rule", "load_balancer": "LoadBalancer"}
    for row in rows:
        if "error" in row:
            lines.append(f"| {','.join(map(str, row['cores']))} | ERROR: {row['error'][:120]} "
                         "| | | | | |")
            continue
        head = (f"| {','.join(map(str, row['cores']))} | "
                f"{', '.join(f'{r:.0f}' for r in row['solo_samples_per_s'])} | "
                f"{row['ideal_speedup']:.2f} |")
        for name in STRATEGIES:
            s = row["strategies"][name]
            v, share = s["samples_per_s"], s["share_of_ideal"]
            lines.append(f"{head} {labels[name]} | {v['median']:.0f} ({v['min']:.0f}-{v['max']:.0f}) "
                         f"| {share['median']:.2f} | {s['plan']} |")
            head = "| | | |"
    lines.append("")
    for row in rows:
        if "error" not in row:
            lb = row["strategies"]["load_balancer"]
            lines.append(f"- {','.join(map(str, row['cores']))}: LoadBalancer efficiency "
                         f"(busy / step, mean over ranks) {lb['efficiency']['median']:.2f}, "
                         f"start cost {lb['start_cost_s']['median']:.2f} s, "
                         f"{row['wall_s']:.0f} s in all")
    return lines

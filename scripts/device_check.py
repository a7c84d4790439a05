"""The device check, in three parts that each fit in 5 minutes (``--part cpu|gpu|fsdp|all``).

Run by scripts/device_check.sh on a machine with one NVIDIA GPU and 16 cores (torch, numpy,
pyyaml; no TensorFlow, no network, no install: ``PYTHONPATH`` is the repository), or
anywhere with ``--cpu-only`` (rank 0 on CPU too) and ``--tiny`` sizes.

Part cpu (``device_check_cpu.py``): ranks pinned to disjoint core sets of 1, 2, 4 and 8 cores,
and of 1, 1, 2, 2, 2, 2, 3, 3 (with ``--tiny``: 1, 1), real heterogeneity without emulation;
writes ``device_check_cpu.{md,json}``.

Part fsdp: part cpu's first configuration (1, 2, 4 and 8 cores) with the model sharded by
FSDP2, the balancer timing each rank outside its all-gathers and reduce-scatters (docs/fsdp.md);
writes ``device_check_fsdp.{md,json}``. Its ranks are CPU ranks: one GPU cannot hold two NCCL
ranks of a job, and Gloo has no reduce-scatter of CUDA tensors.

Part gpu (this file): one GPU rank beside CPU ranks in one Gloo group, exactness and epoch
times; writes ``device_check.{md,json}``. Four processes are started with
``torch.multiprocessing`` (rank 0 on the GPU, ranks 1-3 on CPU cores, the cores split
between them with ``torch.set_num_threads``), one Gloo group, a small ResNet-style CNN with
hvd_balance's SyncBatchNorm on synthetic 32x32 images:

(a) exactness: a few SGD steps under a plan with a 1-sample rank, each rank's loss weighted
    by ``b_i / B`` and the DDP hook summing (GPU buckets staged through host memory), against
    one process on the global batch in float64 on CPU; TF32 off. Largest difference <= 1e-4.
(b) epoch times: the GPU alone on the global batch; GPU + CPUs with equal batches; the paper's
    rule (batches proportional to each rank's measured samples/s); the LoadBalancer (equal
    start, re-planning every few steps, ``optimizer=``: it may leave ranks out), from its
    third epoch against the GPU alone's; with the plans and the ranks left out; each with
    hvd_balance's SyncBatchNorm (a collective per layer) and with torch's per-rank BatchNorm
    (the gradients' only).

Writes ``device_check.json`` and ``device_check.md`` into the output folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hvd_balance.torch as hb  # noqa: E402
from hvd_balance.core.plan import Plan  # noqa: E402
from hvd_balance.core.planner import plan_batches  # noqa: E402

sys.path.insert(0, str(REPO / "scripts"))
from device_check_jobs import (GROUP_TIMEOUT_S, free_port, make_data, measure_rate,  # noqa: E402
                               resnet, train)

WORLD = 4
EXACT_TOLERANCE = 1e-4


def phase_exact(rank, device, cfg):
    """(a): largest parameter/buffer difference after each step, against float64 on CPU."""
    sizes = cfg["exact_sizes"]
    B = sum(sizes)
    data = make_data(B * 3)
    torch.manual_seed(0)
    reference = resnet(cfg["width"]).double()
    model = hb.convert_sync_batchnorm(resnet(cfg["width"])).to(device)
    model.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    sampler = hb.BalancedBatchSampler(data, global_batch_size=B, seed=1)
    balancer = hb.LoadBalancer(ddp, sampler, plan=Plan.from_batch_sizes(sizes), verbose=0)
    diffs = []
    for step, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler)):
        if step == 3:
            break
        opt.zero_grad()
        balancer.scale(F.cross_entropy(ddp(x.to(device)), y.to(device))).backward()
        opt.step()
        balancer.step()
        index = sampler.order(0)[step * B:(step + 1) * B]
        ref_opt.zero_grad()
        F.cross_entropy(reference(data.tensors[0][index].double()), data.tensors[1][index]).backward()
        ref_opt.step()
        ref = reference.state_dict()
        diffs.append(max(float((v.detach().cpu().double() - ref[k]).abs().max())
                         for k, v in model.state_dict().items()))
    return {"sizes": sizes, "diffs": diffs, "max_diff": max(diffs),
            "exact": max(diffs) <= EXACT_TOLERANCE}


def worker(rank, cfg, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    gpu = cfg["gpu"] and rank == 0
    device = torch.device("cuda:0") if gpu else torch.device("cpu")
    torch.set_num_threads(cfg["gpu_threads"] if gpu else cfg["cpu_threads"])
    if gpu:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    results = {"config": cfg, "devices": hb.load_balancer.describe_device(device)}
    results["devices"] = [None] * WORLD
    dist.all_gather_object(results["devices"], hb.load_balancer.describe_device(device))

    def phase(name, fn):
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as err:  # noqa: BLE001 - recorded, and the next phase still runs
            results[name] = {"error": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc()[-3000:]}
        results[name]["phase_s"] = time.perf_counter() - start
        if rank == 0:
            print(f"[device_check] {name}: {json.dumps(results[name])[:600]}", flush=True)

    phase("exact", lambda: phase_exact(rank, device, cfg))
    B = cfg["global_batch"]
    equal = Plan.uniform(B, WORLD)

    def gpu_alone():
        if rank == 0:
            r = train(rank, device, cfg, epochs=cfg["epochs"], alone=True)
        else:
            r = {"epoch_s": []}
        dist.barrier()
        return r
    phase("gpu_alone", gpu_alone)
    rate = measure_rate(device, cfg, equal.batch_sizes[rank])
    rates = [None] * WORLD
    dist.all_gather_object(rates, rate)
    paper_plan = plan_batches(rates, B, method="proportional")
    for bn, suffix in (("sync", ""), ("local", "_local_bn")):
        sync_bn = bn == "sync"
        phase("equal" + suffix, lambda: train(rank, device, cfg, plan=equal, epochs=cfg["epochs"],
                                              sync_bn=sync_bn))
        phase("paper" + suffix, lambda: dict(
            train(rank, device, cfg, plan=paper_plan, epochs=cfg["epochs"], sync_bn=sync_bn),
            samples_per_s=rates))
        phase("load_balancer" + suffix, lambda: train(
            rank, device, cfg, epochs=cfg["balancer_epochs"], rebalance=cfg["rebalance_steps"],
            sync_bn=sync_bn))
    if rank == 0:
        write(results, out_dir)
    hb.end_job()  # torch 2.13's Gloo can abort a plain exit (SIGABRT), failing the spawn


def _mean_tail(values, n):
    tail = values[-n:] if values else []
    return sum(tail) / len(tail) if tail else None


def write(results, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = results["config"]
    lines = [f"# Device check, part gpu ({stamp()})", "",
             f"Ranks: {', '.join(f'{i}: {d}' for i, d in enumerate(results['devices']))}; "
             f"torch {torch.__version__}; global batch "
             f"{cfg['global_batch']}, {cfg['steps']} steps an epoch, ResNet-style CNN width "
             f"{cfg['width']}, 32x32 synthetic images, Gloo.", ""]
    ex = results["exact"]
    if "error" in ex:
        lines.append(f"(a) exactness: ERROR {ex['error']}")
    else:
        lines.append(f"(a) weighted update vs one process (float64, CPU) on the global batch, plan "
                     f"{ex['sizes']}: largest difference per step {', '.join(f'{d:.2e}' for d in ex['diffs'])}"
                     f" -> {'PASS' if ex['exact'] else 'FAIL'} (tolerance {EXACT_TOLERANCE:g}, TF32 off)")
    steady = cfg.get("steady_from", 2)
    alone = results.get("gpu_alone", {}).get("epoch_s") or []
    alone_s = alone[-1] if alone else None  # its last epoch: past cuDNN's first-epoch search
    lines += ["", f"Epoch s: the mean from epoch {steady + 1} for the LoadBalancer (it plans, and "
              "may leave ranks out, at the earlier epochs' ends), the last for the GPU alone, "
              "the mean for fixed plans; *vs GPU alone*: its epoch s over this one (target "
              ">= 0.9 for the LoadBalancer).", "",
              "| strategy | epoch s | epochs | vs GPU alone | plan (local batches) | left out |",
              "|---|---|---|---:|---|---|"]
    rows = [("GPU alone", "gpu_alone")] + [
        (f"GPU + 3 CPUs, {what}, {bn}", key + suffix)
        for bn, suffix in (("SyncBatchNorm", ""), ("per-rank BatchNorm", "_local_bn"))
        for what, key in (("equal", "equal"), ("paper's rule", "paper"),
                          ("LoadBalancer", "load_balancer"))]
    for label, key in rows:
        r = results.get(key, {})
        if "error" in r:
            lines.append(f"| {label} | ERROR: {r['error'][:120]} | | |")
            continue
        epochs = r.get("epoch_s", [])
        shown = (epochs[steady:] or epochs[-1:]) if key.startswith("load_balancer") else \
            epochs[-1:] if key == "gpu_alone" else epochs
        mean = _mean_tail(shown, len(shown))
        r["steady_s"] = mean
        versus = alone_s / mean if alone_s and mean else None
        plan = r.get("final_plan") or (r.get("plans") or [[cfg["global_batch"]]])[-1]
        out = ", ".join(map(str, r["left_out"])) if r.get("left_out") else "-"
        lines.append(f"| {label} | {'-' if mean is None else f'{mean:.3f}'} | "
                     f"{', '.join(f'{e:.3f}' for e in epochs)} | "
                     f"{'-' if versus is None else f'{versus:.2f}'} | {plan} | {out} |")
    if "samples_per_s" in results.get("paper", {}):
        lines += ["", "Measured samples/s per rank (paper's rule): " +
                  ", ".join(f"{r:.0f}" for r in results["paper"]["samples_per_s"])]
    (out_dir / "device_check.md").write_text("\n".join(lines) + "\n")
    (out_dir / "device_check.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(lines), flush=True)


def stamp() -> str:
    """The date, the commit, torch's version and the hardware, for a result's heading."""
    import platform
    import subprocess
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit "
            f"{commit or 'unknown'}, torch {torch.__version__}, {len(os.sched_getaffinity(0))} "
            f"cores ({cpu}), {gpu}")


def part_gpu(args, cores: int) -> None:
    gpu = torch.cuda.is_available() and not args.cpu_only
    gpu_threads = 2 if gpu else max(1, cores // WORLD)
    cpu_threads = max(1, (cores - gpu_threads) // (WORLD - 1))
    cfg = {"gpu": gpu, "cores": cores, "gpu_threads": gpu_threads, "cpu_threads": cpu_threads,
           "port": free_port(), "exact_sizes": [20, 1, 5, 6], "width": 16,
           "global_batch": 256, "steps": 24, "epochs": 2, "balancer_epochs": 4, "steady_from": 2,
           "rebalance_steps": 8, "rate_repeats": 5}
    if args.tiny:
        cfg.update(exact_sizes=[5, 1, 3, 2], width=4, global_batch=32, steps=6, epochs=1,
                   balancer_epochs=2, rebalance_steps=3, rate_repeats=2)
    print(f"[device_check] part gpu: {json.dumps(cfg)}", flush=True)
    mp.spawn(worker, args=(cfg, Path(args.out)), nprocs=WORLD, join=True)


def part_cpu(args, cores: int, sharded: bool = False) -> None:
    """Part cpu, or with ``sharded`` part fsdp: the same ranks and jobs under FSDP2."""
    import device_check_cpu as cpu

    # A CNN whose compute outweighs its allreduce (about 0.7 M parameters, width 32).
    cfg = {"width": 32, "global_batch": 256, "steps": 8, "epochs": 1, "balancer_epochs": 3,
           "rebalance_steps": 4, "rate_repeats": 3, "repeats": 3, "sharded": sharded}
    configs = [(1, 2, 4, 8)] if sharded else [(1, 2, 4, 8), (1, 1, 2, 2, 2, 2, 3, 3)]
    if args.tiny:
        cfg.update(width=4, global_batch=32, steps=6, balancer_epochs=2, rebalance_steps=3,
                   rate_repeats=2, repeats=2)
        configs = [(1, 1)]
    part = "fsdp" if sharded else "cpu"
    print(f"[device_check] part {part}: {json.dumps(cfg)}, configurations {configs}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in configs:
        try:
            rows.append(cpu.run_config(config, cfg))
        except Exception as err:  # noqa: BLE001 - recorded, and the next configuration still runs
            rows.append({"cores": list(config), "error": f"{type(err).__name__}: {err}"})
        print(f"[device_check] part {part} {config}: {json.dumps(rows[-1])[:600]}", flush=True)
    wrapped = ("FSDP2 (`fully_shard` on each block, then the root)" if sharded
               else "DDP")
    lines = [f"# Device check, part {part} ({stamp()})", "",
             f"Ranks pinned to disjoint core sets, one thread per core; ResNet-style CNN of width "
             f"{cfg['width']} on 32x32 synthetic images in {wrapped}, per-rank BatchNorm, global "
             f"batch {cfg['global_batch']}, {cfg['steps']} steps an epoch, Gloo; {cfg['repeats']} "
             f"interleaved rounds.", ""] + cpu.report(rows, cfg)
    (out / f"device_check_{part}.json").write_text(json.dumps({"config": cfg, "rows": rows},
                                                              indent=1))
    (out / f"device_check_{part}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default="results", help="output folder (default: results/)")
    p.add_argument("--part", choices=["cpu", "gpu", "fsdp", "all"], default="all",
                   help="cpu: pinned core sets; gpu: the GPU beside CPU ranks; fsdp: the core "
                        "sets under FSDP2; all: the three")
    p.add_argument("--cpu-only", action="store_true", help="rank 0 on CPU too (automatic without CUDA)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a one-minute run on a laptop")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    if args.part in ("cpu", "all"):
        part_cpu(args, cores)
    if args.part in ("gpu", "all"):
        part_gpu(args, cores)
    if args.part in ("fsdp", "all"):
        part_cpu(args, cores, sharded=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

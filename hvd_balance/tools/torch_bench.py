"""The torch edge's benchmark: plain DDP batches, the paper's rule and ``LoadBalancer`` on CPU.

``python -m hvd_balance.tools.torch_bench`` trains one small CNN with ``hvd_balance.torch``
under each strategy, each job on its own, the strategies interleaved within every repetition
(so a slow patch of the machine falls on all of them alike), and prints a table:

- **uniform**: what plain DDP does, ``B / N`` samples on every rank;
- **proportional**: the paper's rule (Moreno-Alvarez et al. 2020): each rank times a few
  steps alone at ``B / N`` samples, then batches proportional to the measured samples/s, kept;
- **balanced**: ``hvd_balance.torch.LoadBalancer(model, sampler, optimizer=optimizer)`` with
  every default (it may leave a rank out);
- **without** (with ``--without 2``): the same job launched without those ranks, balanced:
  the best subset run on its own, what leaving ranks out should match.

Every job weights each rank's loss by ``b_i / B`` and sums (the same hook), so only the split
differs. ``--fixed-ms 0,0,60`` adds a fixed cost to each step of a rank (a wait of that many
milliseconds where the slowdown waits): a device whose per-step overhead outweighs its work. ``--lightning`` trains in a Lightning ``Trainer`` instead of a hand-written loop:
*uniform* is then Lightning's own ``DDPStrategy`` (``batch_size = B / N`` and its
``DistributedSampler``), *proportional* and *balanced* ``hvd_balance.lightning``'s
``BalancedDDPStrategy`` with the paper's plan and with every default. ``--fsdp`` shards the
model with FSDP2 (each layer with parameters, then the root) instead of DDP: every strategy
then sums the reduce-scatters of the weighted gradients, and a rank's busy time leaves out
its seconds in the collectives. Two emulations of slow devices, as ``python -m hvd_balance.bench`` has
(docs/emulation.md): ``--shares 1.0,0.25`` caps each rank with a cgroup CPU quota (root; it
also slows the rank's side of the collectives), ``--slowdown 1,4`` makes rank ``i`` wait
``k_i - 1`` times its measured compute once its backward is done, before its last gradient
bucket goes to the allreduce (counted as busy time: a slower device, not a slower link). A rank's busy time runs, as
``hvd_balance.torch``'s telemetry counts it, from the end of its previous step (fetching the
batch included) to its first layer's gradient. Each
rank runs one thread, pinned to a core as the TensorFlow benchmark pins them.

*epoch s*: the median over the steady epochs (the 2nd and later, or ``--steady-from``) and
repetitions; *speedup*:
uniform's epoch over the strategy's; *share of ideal*: the speedup over the ideal one (equal
finish times, no overhead) from each rank's samples/s in the uniform jobs
(:func:`hvd_balance.tools.bench.figures.share_of_ideal`); *efficiency*: per steady step, the
ranks' mean busy time over the largest.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .bench.figures import share_of_ideal
from .bench.worker import make_data
from .emulate import (DEFAULT_PERIOD_US, CpuQuotaGroups, assign_cores, parse_cpu_shares,
                      parse_slowdowns)

STRATEGIES = ("uniform", "proportional", "balanced")
RATE_STEPS = 6          # the paper's benchmark: steps timed alone (after one warm-up step)
JOB_TIMEOUT_S = 900     # a job that runs longer than this is killed and reported as failed


# ----------------------------------------------------------------------------------------
# One rank of one job (a subprocess of the driver).

def _model(name: str):
    import torch.nn as nn

    if name == "cnn":  # the TensorFlow benchmark's "cnn": 16x16x1 images, 188k parameters
        return (1, 16, 16), nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))
    if name == "tiny":  # for the smoke test
        return (1, 8, 8), nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                        nn.Linear(8 * 8 * 8, 10))
    raise ValueError(f"unknown model {name!r}; choose cnn or tiny")


class _Timer:
    """Times each step's busy part as hvd_balance.torch's telemetry does (from the end of the
    previous step, so fetching the batch counts, to the first layer's gradient) and applies
    the ``--slowdown`` wait there: ``k - 1`` times the compute (forward start to that
    gradient), before the last bucket's allreduce. ``sharded`` (FSDP2): every layer with
    parameters waits ``k - 1`` times its own forward and its own backward, as it ends (a
    slower device is slower between all of the step's collectives, not at one of them), the
    seconds in the collectives are not compute, and the step's busy time ends with the first
    layer's backward (its parameters' hooks are the sharded ones', which backward does not
    reach)."""

    def __init__(self, model, slowdown: float, fixed_s: float = 0.0, sharded: bool = False):
        self.slowdown, self.fixed_s, self.busy_s = float(slowdown), float(fixed_s), []
        self.step_start = self._forward_start = None
        self._waited = False
        self._collective_s = lambda: 0.0
        model.register_forward_pre_hook(self._forward_begins)
        first = next(m for m in model.modules() if list(m.parameters(recurse=False)))
        self._per_layer = sharded
        if sharded:
            from hvd_balance.torch.distributed import collective_seconds

            self._collective_s = collective_seconds
            # torch warns that the hook fires on the outputs' gradients: the inputs are data
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            for layer in [m for m in model.modules() if list(m.parameters(recurse=False))]:
                layer.register_forward_pre_hook(lambda *_: self._segment_begins())
                layer.register_forward_hook(lambda *_: self._segment_ends())
                layer.register_full_backward_pre_hook(lambda *_: self._segment_begins())
                layer.register_full_backward_hook(lambda *_: self._segment_ends())
            first.register_full_backward_hook(lambda *_: self._last_gradients(None))
        else:
            for p in first.parameters(recurse=False):  # the last gradients backward computes
                p.register_hook(self._last_gradients)

    def step_begins(self):
        """Call where a step begins: before the batch is fetched."""
        self.step_start = time.perf_counter()
        self._step_collective_s = self._collective_s()

    def _forward_begins(self, module, args):
        self._forward_start, self._waited = time.perf_counter(), False
        self._forward_collective_s = self._collective_s()
        if self.step_start is None:
            self.step_start, self._step_collective_s = self._forward_start, self._forward_collective_s

    def _segment_begins(self):
        self._segment = (time.perf_counter(), self._collective_s())

    def _segment_ends(self):
        start, waited = self._segment
        compute = time.perf_counter() - start - (self._collective_s() - waited)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * max(compute, 0.0))

    def _last_gradients(self, grad):
        if not self._waited and self._forward_start is not None:
            self._waited = True
            waited = self._collective_s()
            compute = time.perf_counter() - self._forward_start - (waited - self._forward_collective_s)
            slowed = 0.0 if self._per_layer else (self.slowdown - 1) * compute  # done per layer
            if slowed > 0 or self.fixed_s > 0:
                time.sleep(slowed + self.fixed_s)
            self.busy_s.append(time.perf_counter() - self.step_start
                               - (waited - self._step_collective_s))
            self.step_start = None
        return grad


def _paper_rate(model, timer: _Timer, shape, batch: int) -> float:
    """This rank's samples/s alone at ``batch`` samples (the paper's benchmark phase)."""
    import torch
    import torch.nn.functional as F

    x, y = torch.randn(batch, *shape), torch.zeros(batch, dtype=torch.long)
    times = []
    for i in range(RATE_STEPS + 1):
        t = time.perf_counter()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if i:  # the first step allocates
            times.append(time.perf_counter() - t)
    timer.busy_s.clear()
    timer.step_start = None
    return batch / statistics.median(times)


def _loop_epochs(cfg, model, data, timer: _Timer, plan, start: float):
    """A hand-written DDP (or FSDP2) loop with hvd_balance.torch: (epoch records, decisions,
    start s)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    import hvd_balance.torch as hb

    if cfg.get("fsdp"):  # each layer with parameters sharded, then the root (FSDP2's way)
        from torch.distributed.fsdp import fully_shard

        for layer in [m for m in model.modules() if list(m.parameters(recurse=False))]:
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = DDP(model)
    sampler = hb.BalancedBatchSampler(data, global_batch_size=cfg["global_batch"], seed=0)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
    balancer = hb.LoadBalancer(wrapped, sampler, plan=plan, verbose=0, optimizer=opt)
    start_s = time.perf_counter() - start
    loader = DataLoader(data, batch_sampler=sampler)
    epochs = []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        timer.busy_s.clear()
        dist.barrier()
        t = time.perf_counter()
        plan_used = list(balancer.plan.batch_sizes)
        timer.step_begins()
        for xb, yb in loader:
            opt.zero_grad()
            balancer.scale(F.cross_entropy(wrapped(xb), yb)).backward()
            opt.step()
            balancer.step()
            timer.step_begins()
        dist.barrier()
        epochs.append(_epoch_record(time.perf_counter() - t, plan_used, timer))
    return epochs, [h["decision"] for h in balancer.history], start_s


def _lightning_epochs(cfg, model, data, timer: _Timer, plan, start: float):
    """The same training in a Lightning Trainer: Lightning's DDPStrategy (``plan`` uniform),
    else hvd_balance.lightning's BalancedDDPStrategy; (epoch records, decisions, start s)."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import hvd_balance.lightning as hbl

    world, B = dist.get_world_size(), cfg["global_batch"]
    lightning_ddp = cfg["strategy"] == "uniform"
    strategy = (pl.strategies.DDPStrategy() if lightning_ddp
                else hbl.BalancedDDPStrategy(seed=0, plan=plan, verbose=0))
    epochs, marks = [], {}

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Epochs(pl.Callback):
        def on_train_start(self, trainer, module):
            marks["start_s"] = time.perf_counter() - start

        def on_train_epoch_start(self, trainer, module):
            timer.busy_s.clear()
            dist.barrier()
            marks["t"] = time.perf_counter()
            marks["plan"] = ([B // world] * world if lightning_ddp
                             else list(strategy.balancer.plan.batch_sizes))
            timer.step_begins()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            timer.step_begins()

        def on_train_epoch_end(self, trainer, module):
            dist.barrier()
            epochs.append(_epoch_record(time.perf_counter() - marks["t"], marks["plan"], timer))

    trainer = pl.Trainer(max_epochs=cfg["epochs"], accelerator="cpu", devices=world,
                         strategy=strategy, callbacks=[Epochs()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Net(), DataLoader(data, batch_size=B // world, shuffle=True))
    decisions = [] if lightning_ddp else [h["decision"] for h in strategy.balancer.history]
    return epochs, decisions, marks["start_s"]


def _epoch_record(epoch_s: float, plan_used, timer: _Timer) -> Dict[str, Any]:
    return {"epoch_s": epoch_s, "plan": plan_used,
            "busy_ms": 1000 * statistics.median(timer.busy_s[1:] or timer.busy_s),
            "busy_all_ms": [1000 * b for b in timer.busy_s]}


def _worker(cfg: Dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    from hvd_balance.core.plan import Plan
    from hvd_balance.core.planner import plan_batches

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.sched_setaffinity(0, cfg["cores"][rank])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    shape, model = _model(cfg["model"])
    x, y = make_data(shape, cfg["samples"], seed=0)  # the TensorFlow benchmark's data
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())
    torch.manual_seed(0)
    timer = _Timer(model, cfg["slowdowns"][rank], cfg["fixed_s"][rank], cfg.get("fsdp", False))
    B, strategy = cfg["global_batch"], cfg["strategy"]
    start = time.perf_counter()
    plan, rates = None, None
    if strategy == "uniform":
        plan = Plan.uniform(B, world)
    elif strategy == "proportional":
        rates = [None] * world
        dist.all_gather_object(rates, _paper_rate(model, timer, shape, B // world))
        plan = plan_batches(rates, B, method="proportional")
    if cfg.get("lightning"):
        epochs, decisions, start_s = _lightning_epochs(cfg, model, data, timer, plan, start)
    else:
        epochs, decisions, start_s = _loop_epochs(cfg, model, data, timer, plan, start)
    out = {"rank": rank, "epochs": epochs, "start_s": start_s, "paper_rates": rates,
           "decisions": decisions}
    Path(cfg["out_dir"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    # Not a normal exit: Gloo's threads sometimes abort the interpreter's teardown (torch 2.13:
    # "terminate called without an active exception"), after the record is written.
    sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------
# The driver.

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(cfg: Dict[str, Any], shares: Optional[Sequence[float]], period_us: int) -> List[Dict]:
    """Runs one job of ``len(cfg["slowdowns"])`` ranks; returns each rank's record."""
    world = len(cfg["slowdowns"])
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = dict(cfg, out_dir=out_dir)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        groups = CpuQuotaGroups(shares, period_us).create() if shares else None
        procs = []
        try:
            for rank in range(world):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "hvd_balance.tools.torch_bench", "--worker",
                     json.dumps(cfg)], env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
                if groups is not None:
                    groups.add_process(rank, procs[-1].pid)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            if groups is not None:
                groups.remove()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"{cfg['strategy']} job: ranks {failed} failed "
                               f"(exit codes {[procs[r].returncode for r in failed]})")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def summarize(jobs: List[Dict[str, Any]], global_batch: int,
              steady_from: int = 2) -> List[Dict[str, Any]]:
    """One row per strategy: steady epoch s (epochs ``steady_from`` on, counting from 1),
    plans, speedup, share of ideal, efficiency."""
    rows = []
    uniform_rates = None
    for strategy in STRATEGIES + ("without",):
        mine = [j for j in jobs if j["strategy"] == strategy]
        if not mine:
            continue
        epoch_s, busy, eff, plans = [], [], [], []
        for j in mine:
            per_epoch = list(zip(*[r["epochs"] for r in j["ranks"]]))[steady_from - 1:]
            for ranks in per_epoch:
                epoch_s.append(ranks[0]["epoch_s"])
                busy.append([r["busy_ms"] for r in ranks])
                training = [b for b, n in zip(busy[-1], ranks[0]["plan"]) if n]  # not left out
                eff.append(statistics.mean(training) / max(training))
                plans.append(ranks[0]["plan"])
        row = {"strategy": strategy, "epoch_s": statistics.median(epoch_s),
               "epoch_s_all": epoch_s, "plans": plans, "efficiency": statistics.median(eff),
               "busy_ms": [statistics.median(b[k] for b in busy) for k in range(len(busy[0]))],
               "start_s": statistics.median(j["ranks"][0]["start_s"] for j in mine)}
        if strategy == "uniform":
            local = global_batch // len(row["busy_ms"])
            uniform_rates = [local / (b / 1000) for b in row["busy_ms"]]
            row["samples_per_s"] = uniform_rates
        rows.append(row)
    base = next((r for r in rows if r["strategy"] == "uniform"), None)
    for row in rows:
        if base is not None:
            row["speedup"] = base["epoch_s"] / row["epoch_s"]
            row["share_of_ideal"] = share_of_ideal(row["speedup"], uniform_rates)
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| strategy | local batches (last steady epoch) | epoch s (median) | speedup | "
             "share of ideal | efficiency | start s |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {', '.join(map(str, r['plans'][-1]))} | "
                     f"{r['epoch_s']:.2f} | {r.get('speedup', float('nan')):.2f}x | "
                     f"{r.get('share_of_ideal', float('nan')):.3f} | {r['efficiency']:.3f} | "
                     f"{r['start_s']:.2f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hvd_balance.tools.torch_bench",
                                description=__doc__.split("\n\n")[0])
    emulation = p.add_mutually_exclusive_group(required=True)
    emulation.add_argument("--shares", help="CPU cores per rank, a cgroup quota each (root), "
                                            "e.g. 1.0,0.25")
    emulation.add_argument("--slowdown", help="compute slowdown per rank, e.g. 1,4")
    p.add_argument("--period-us", type=int, default=DEFAULT_PERIOD_US, help="the quotas' period")
    p.add_argument("--fixed-ms", help="a fixed cost per step per rank, milliseconds, e.g. 0,0,60")
    p.add_argument("--without", help="ranks to launch the 'without' job without, e.g. 2")
    p.add_argument("--model", default="cnn", choices=("cnn", "tiny"))
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--reps", type=int, default=3, help="repetitions of every strategy")
    p.add_argument("--epochs", type=int, default=4, help="epochs a job (the first is not steady)")
    p.add_argument("--steady-from", type=int, default=2,
                   help="the first epoch counted (from 1): later where ranks are left out")
    p.add_argument("--global-batch", type=int, default=512, help="B, samples a step")
    p.add_argument("--samples", type=int, default=25600, help="training samples")
    p.add_argument("--lightning", action="store_true",
                   help="train in a Lightning Trainer (uniform: Lightning's own DDPStrategy)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2's fully_shard instead of DDP (the loop)")
    p.add_argument("--out", help="JSON file for every job's records and the summary")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(json.loads(argv[1]))
        return 0
    args = _parser().parse_args(argv)
    if args.fsdp and args.lightning:
        raise SystemExit("--fsdp trains in the hand-written loop; drop --lightning")
    strategies = args.strategies.split(",") + (["without"] if args.without else [])
    unknown = sorted(set(strategies) - set(STRATEGIES) - {"without"})
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    shares = parse_cpu_shares(args.shares) if args.shares else None
    slowdowns = parse_slowdowns(args.slowdown) if args.slowdown else (1.0,) * len(shares)
    world = len(slowdowns)
    cores = tuple(sorted(os.sched_getaffinity(0)))
    loads = shares if shares else [1.0 / k for k in slowdowns]
    fixed = [float(v) / 1000 for v in args.fixed_ms.split(",")] if args.fixed_ms else [0.0] * world
    if len(fixed) != world or min(fixed) < 0:
        raise SystemExit(f"--fixed-ms needs {world} values >= 0; got {args.fixed_ms!r}")
    without = sorted({int(r) for r in args.without.split(",")}) if args.without else []
    if any(not 0 <= r < world for r in without) or len(without) >= world:
        raise SystemExit(f"--without needs ranks of the job (0..{world - 1}), not all; "
                         f"got {args.without!r}")
    cfg = {"model": args.model, "global_batch": args.global_batch, "samples": args.samples,
           "epochs": args.epochs, "slowdowns": list(slowdowns), "lightning": args.lightning,
           "fsdp": args.fsdp,
           "fixed_s": fixed,
           "cores": [list(c) for c in assign_cores([min(1.0, s) for s in (shares or [1.0] * world)],
                                                    cores, loads)]}
    jobs = []
    for rep in range(args.reps):
        for strategy in strategies:
            t = time.perf_counter()
            job = dict(cfg, strategy=strategy)
            if strategy == "without":  # the balanced job on the other ranks alone
                kept = [r for r in range(world) if r not in without]
                job = dict(job, strategy="balanced", **{
                    k: [cfg[k][r] for r in kept] for k in ("slowdowns", "fixed_s", "cores")})
            ranks = run_job(job, [shares[r] for r in range(world) if strategy != "without"
                                  or r not in without] if shares else None, args.period_us)
            jobs.append({"strategy": strategy, "rep": rep, "ranks": ranks})
            print(f"rep {rep} {strategy}: epochs "
                  f"{[round(e['epoch_s'], 2) for e in ranks[0]['epochs']]} s, plans "
                  f"{[e['plan'] for e in ranks[0]['epochs']]} ({time.perf_counter() - t:.0f} s)",
                  flush=True)
    rows = summarize(jobs, args.global_batch, args.steady_from)
    print(table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "config": cfg, "jobs": jobs,
                                              "summary": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

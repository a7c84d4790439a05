"""What a window costs while a rank is left out: seconds at each epoch's end, by rank.

Usage: torchrun --standalone --nproc-per-node 3 -m hvd_balance.tools.window_bench [--width 4096]
    [--layers 3] [--epochs 6] [--out window.json]

A model of ``layers`` square linear layers (``--width 4096 --layers 3``: 50.3 M parameters)
with Adam, 3 CPU ranks on Gloo, 2 steps an epoch of 6 samples. A scripted controller leaves
rank 2 out at epoch 0's end, keeps it out, and takes it back at the end of the second to last
epoch. Every rank times each epoch-end ``balancer.step()`` (the window: the gather, the
decision, the state a rank out or taken back receives); rank 0 prints and writes them as JSON.
Public API only, so the same command measures any commit.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb
from hvd_balance.core.controller import Decision


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(12, args.width), torch.randn(12, args.width))
    windows = []

    class Scripted:
        def next(self, plan, window):
            windows.append(1)
            out = 1 <= len(windows) < args.epochs - 1
            sizes = [3, 3, 0] if out else [2, 2, 2]
            return Decision(hb.Plan.from_batch_sizes(sizes), "switched", 0.001, window.step_s,
                            0.0), self

    sampler = hb.BalancedBatchSampler(data, global_batch_size=6, seed=0)
    balancer = hb.LoadBalancer(model, sampler, optimizer=opt, controller=Scripted(),
                               rebalance="epoch", verbose=0)
    seconds, plans = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        plans.append(list(balancer.plan.batch_sizes))
        batches = list(DataLoader(data, batch_sampler=sampler))
        for i, (x, y) in enumerate(batches):
            opt.zero_grad()
            balancer.scale(nn.functional.mse_loss(model(x), y)).backward()
            opt.step()
            last = i == len(batches) - 1
            start = time.perf_counter()
            balancer.step()
            if last:
                seconds.append(time.perf_counter() - start)
    everyone = [None] * size
    dist.all_gather_object(everyone, seconds)
    if rank == 0:
        result = {"parameters": sum(p.numel() for p in model.parameters()), "plans": plans,
                  "window_s": everyone}
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    hb.end_job()


if __name__ == "__main__":
    main()

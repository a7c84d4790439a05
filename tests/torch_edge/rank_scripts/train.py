"""A short balanced DDP job with a fault or a slowdown.

Usage: torchrun --nproc-per-node N train.py MODE [ARG]
  slow K       rank N-1 sleeps (K-1) x its compute before the allreduce; 3 epochs, rebalance
               every 6 steps; emits the plans.
  die          rank 1 SIGKILLs itself at step 5; the others go on training.
  bad_batch    ranks disagree on the global batch (64 on rank 0, 48 elsewhere).
  bad_world    a plan for 3 ranks.
  plan FILE    LoadBalancer(plan=FILE).
  capped K C   as slow K, with max_batch_size=[C, None, ...]: every plan keeps rank 0 <= C.
  bad_caps C   max_batch_size=C on every rank (too small for the global batch of 64).
  probe        max_batch_size="probe" (CPU ranks: no caps); emits the plan's caps.
  fixed S DIR  rank N-1 sleeps S seconds a step (a fixed cost); 2 epochs, rebalance every 6
               steps, save_plan=DIR/plan.yaml, verbose; emits the plans and the history.
Each rank emits {"rank", "error", "plans", ...}: the error as "<type>: <message>" or null.
"""
import os
import signal
import sys
import time

from _common import emit, finish, init

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb

rank, size = init()
mode, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
save_plan = f"{sys.argv[3]}/plan.yaml" if mode == "fixed" else None
torch.manual_seed(0)
x = torch.randn(1536, 32)
y = (x[:, 0] > 0).long()
data = TensorDataset(x, y)
model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
B = 48 if (mode == "bad_batch" and rank > 0) else 64
plan = {"bad_world": hb.Plan.from_batch_sizes([30, 20, 14]), "plan": arg}.get(mode)
error, plans, balancer = None, [], None
try:
    sampler = hb.BalancedBatchSampler(data, global_batch_size=B, seed=0)
    caps = ([int(sys.argv[3])] + [None] * (size - 1) if mode == "capped" else
            int(arg) if mode == "bad_caps" else "probe" if mode == "probe" else None)
    balancer = hb.LoadBalancer(model, sampler, plan=plan, verbose=int(mode == "fixed"),
                               rebalance=6 if mode in ("slow", "capped", "fixed") else None,
                               save_plan=save_plan, max_batch_size=caps, probe_input=x[:2])
    for epoch in range({"slow": 3, "capped": 3, "fixed": 2}.get(mode, 1)):
        sampler.set_epoch(epoch)
        for step, (xb, yb) in enumerate(DataLoader(data, batch_sampler=sampler)):
            if mode == "die" and rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            if mode in ("slow", "capped") and rank == size - 1:
                # compute is about proportional to the batch: sleep (K-1) x a measured step
                t0 = time.perf_counter()
                model.module(xb).sum().backward()
                model.zero_grad()
                time.sleep((float(arg) - 1) * (time.perf_counter() - t0))
            if mode == "fixed" and rank == size - 1:
                time.sleep(float(arg))
            balancer.scale(loss).backward()
            opt.step()
            balancer.step()
        plans.append(list(balancer.plan.batch_sizes))
except (ValueError, TypeError, RuntimeError) as err:
    error = f"{type(err).__name__}: {err}"
emit({"rank": rank, "error": error, "plans": plans,
      "caps": balancer and balancer.plan.max_batch_sizes,
      "leave_out": [h["leave_out"] for h in balancer.history] if balancer else None})
finish()

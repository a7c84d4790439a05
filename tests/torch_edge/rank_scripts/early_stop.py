"""Rank 1 leaves its loop in the middle of epoch 0; it lives on and writes its result.

Usage: torchrun --nproc-per-node 2 early_stop.py MODE
  stop     rank 1 calls balancer.stop("loss is nan") then breaks after step 5 (6 steps done).
  break    rank 1 breaks after step 5, no reason given.
  normal   no rank leaves (2 epochs of 24 steps).
Each rank emits {"rank", "steps" (per epoch), "stopped", "seconds" (its loop's), "after"},
then both ranks meet in a barrier (the groups must still be in step).
"""
import sys
import time

from _common import emit, finish, init

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb

rank, size = init()
mode = sys.argv[1]
torch.manual_seed(0)
x = torch.randn(1536, 32)
y = (x[:, 0] > 0).long()
data = TensorDataset(x, y)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sampler = hb.BalancedBatchSampler(data, global_batch_size=64, seed=0)
balancer = hb.LoadBalancer(model, sampler, verbose=0)
steps, start = [], time.monotonic()
for epoch in range(2):
    sampler.set_epoch(epoch)
    done = 0
    for step, (xb, yb) in enumerate(DataLoader(data, batch_sampler=sampler)):
        opt.zero_grad()
        balancer.scale(nn.functional.cross_entropy(model(xb), yb)).backward()
        opt.step()
        balancer.step()
        done += 1
        if mode in ("stop", "break") and rank == 1 and epoch == 0 and step == 5:
            if mode == "stop":
                balancer.stop("loss is nan")
            break
    steps.append(done)
    if balancer.stopped:
        break
seconds = time.monotonic() - start
emit({"rank": rank, "steps": steps, "stopped": balancer.stopped, "seconds": seconds,
      "after": "alive"})
finish()

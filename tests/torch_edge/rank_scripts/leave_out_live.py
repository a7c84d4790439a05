"""The controller leaves a costly rank out, and takes it back once it is fast.

Usage: torchrun --nproc-per-node 2 leave_out_live.py
A small CNN whose compute dominates its allreduce. Rank 1 sleeps 0.15 s a step (a fixed
cost several times rank 0's whole step) in epochs 0 and 1, and not from epoch 2 on; 5 epochs
of 10 steps, windows every 4 steps, LoadBalancer with ``optimizer=``. Every rank emits the plan of each epoch, each epoch's seconds and, at the
end, the largest difference between its weights and rank 0's.
"""
import time

from _common import emit, finish, init

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb

rank, size = init()
torch.manual_seed(0)
x = torch.randn(640, 1, 16, 16)
y = (x[:, 0, 0, 0] > 0).long()
data = TensorDataset(x, y)
model = DDP(nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = hb.BalancedBatchSampler(data, global_batch_size=64, seed=0)
balancer = hb.LoadBalancer(model, sampler, optimizer=opt, rebalance=4)
plans, epoch_s = [], []
for epoch in range(5):
    sampler.set_epoch(epoch)
    plans.append(list(balancer.plan.batch_sizes))
    start = time.perf_counter()
    for xb, yb in DataLoader(data, batch_sampler=sampler):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        if rank == 1 and epoch < 2:
            time.sleep(0.15)
        balancer.scale(loss).backward()
        opt.step()
        balancer.step()
    epoch_s.append(time.perf_counter() - start)
weights = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
rank0 = weights.clone()
dist.broadcast(rank0, 0)
emit({"rank": rank, "plans": plans, "epoch_s": epoch_s,
      "differs": float((weights - rank0).abs().max()),
      "history": [{k: h[k] for k in ("epoch", "step", "batch_sizes", "decision", "busy_ms",
                                     "step_ms", "predicted_ms")}
                  for h in balancer.history]})
finish()

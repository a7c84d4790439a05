"""An FSDP2 job with a costly rank and a memory cap: what the balancer measures and plans.

Usage: torchrun --nproc-per-node 2 fsdp_train.py CAP
Two blocks and a head, each block sharded, then the root; B = 64; 2 epochs of 20 steps,
a window every 5 steps. Rank 1 waits 40 ms a step where its forward begins (its compute, as
the balancer sees it: outside the collectives), several times rank 0's whole step; rank 0's
local batch is capped at CAP samples (``max_batch_size=[CAP, None]``). Every rank emits the
plans, its history and whether any plan left a rank out.
"""
import sys
import time

from _common import emit, finish, init

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb

rank, size = init()
cap = int(sys.argv[1])
B, STEPS = 64, 20
torch.manual_seed(0)
x = torch.randn(STEPS * B, 32)
y = (x[:, 0] > 0).long()
model = nn.Sequential(nn.Sequential(nn.Linear(32, 64), nn.ReLU()),
                      nn.Sequential(nn.Linear(64, 64), nn.ReLU()), nn.Linear(64, 2))
if rank == 1:
    model.register_forward_pre_hook(lambda *_: time.sleep(0.04))
for block in (model[0], model[1]):
    fully_shard(block)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
dataset = TensorDataset(x, y)
sampler = hb.BalancedBatchSampler(dataset, global_batch_size=B, seed=0)
balancer = hb.LoadBalancer(model, sampler, optimizer=opt, rebalance=5,
                           max_batch_size=[cap, None])
loader = DataLoader(dataset, batch_sampler=sampler)
loss_fn = nn.CrossEntropyLoss()
plans = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        plans.append(list(balancer.plan.batch_sizes))
        opt.zero_grad()
        balancer.scale(loss_fn(model(xb), yb)).backward()
        opt.step()
        balancer.step()
emit({"rank": rank, "plans": plans, "history": balancer.history})
finish()

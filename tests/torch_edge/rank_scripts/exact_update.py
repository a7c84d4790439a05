"""The weighted update on N ranks against one process on the global batch.

Usage: torchrun --nproc-per-node N exact_update.py B0,B1,... [syncbn] [flood]
Every rank trains STEPS steps (flood: 40 in float64, 50 ms apart, while a test sends forged
datagrams to its ports; it also emits how many its note board dropped) under the given plan (LoadBalancer(plan=...), DDP with the sum
hook, loss scaled by b_i / B), and in the same process a copy of the model trains on the
whole global batch of each step; every rank emits the largest parameter (and batch norm
running statistic) difference after each step.
"""
import sys
import time

from _common import emit, exactness_job, finish, init

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb
from hvd_balance.torch import stop

rank, size = init()
sizes = [int(b) for b in sys.argv[1].split(",")]
syncbn = "syncbn" in sys.argv[2:]
flood = "flood" in sys.argv[2:]
STEPS = 40 if flood else 3
if flood:  # float64: 40 steps stay exact to 1e-9
    torch.set_default_dtype(torch.float64)
B = sum(sizes)
x, y, reference, model = exactness_job(STEPS * B + 3, syncbn)
dataset = TensorDataset(x, y)
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()

sampler = hb.BalancedBatchSampler(dataset, global_batch_size=B, seed=3)
balancer = hb.LoadBalancer(model, sampler, plan=hb.Plan.from_batch_sizes(sizes), verbose=0)
loader = DataLoader(dataset, batch_sampler=sampler)


def largest_difference():
    pairs = list(zip(model.module.state_dict().values(), reference.state_dict().values()))
    return max(float((a.double() - b.double()).abs().max()) for a, b in pairs)


diffs, local = [], []
for step, (xb, yb) in enumerate(loader):
    if step == STEPS:
        break
    local.append(len(xb))
    opt.zero_grad()
    balancer.scale(loss_fn(model(xb), yb)).backward()
    opt.step()
    balancer.step()
    index = sampler.order(0)[step * B:(step + 1) * B]
    ref_opt.zero_grad()
    loss_fn(reference(x[index]), y[index]).backward()
    ref_opt.step()
    diffs.append(largest_difference())
    if flood:
        time.sleep(0.05)
emit({"rank": rank, "diffs": diffs, "local_batches": local,
      "dropped": stop.open_board().channel.dropped})
finish()

"""A rank leaves its loop mid-epoch while another rank is left out: no rank waits.

Usage: torchrun --nproc-per-node 3 leave_out_stop.py LEAVER [syncbn]
3 epochs of 5 steps; a scripted controller leaves rank 2 out at the end of epoch 0. In epoch
1, rank LEAVER (0 or 1, training; 2: the rank left out, in its probe step) calls
``balancer.stop("loss is nan")`` and breaks after its step 2. Each rank emits its steps per
epoch, ``LoadBalancer.stopped`` and its loop's seconds, then all meet in a barrier (the
groups must still be in step).
"""
import sys
import time

from _common import emit, exactness_job, finish, init

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb
from hvd_balance.core.controller import Decision

rank, size = init()
leaver = int(sys.argv[1])
x, y, _, model = exactness_job(5 * 12 + 3, "syncbn" in sys.argv[2:])
dataset = TensorDataset(x, y)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class Scripted:
    def next(self, plan, window):
        return Decision(hb.Plan.from_batch_sizes([8, 4, 0]), "switched", 0.001, window.step_s,
                        0.0), self


sampler = hb.BalancedBatchSampler(dataset, global_batch_size=12, seed=3)
balancer = hb.LoadBalancer(model, sampler, optimizer=opt, controller=Scripted(), verbose=0)
steps, start = [], time.monotonic()
for epoch in range(3):
    sampler.set_epoch(epoch)
    steps.append(0)
    for step, (xb, yb) in enumerate(DataLoader(dataset, batch_sampler=sampler)):
        opt.zero_grad()
        balancer.scale(nn.functional.cross_entropy(model(xb), yb)).backward()
        opt.step()
        balancer.step()
        steps[-1] += 1
        if epoch == 1 and rank == leaver and step == (0 if rank == 2 else 2):
            balancer.stop("loss is nan")
            break
emit({"rank": rank, "steps": steps, "stopped": balancer.stopped,
      "seconds": time.monotonic() - start})
finish()

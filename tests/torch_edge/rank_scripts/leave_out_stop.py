"""A rank leaves its loop while another rank is left out: no rank waits.

Usage: torchrun --nproc-per-node 3 leave_out_stop.py LEAVER WHEN [syncbn]
3 epochs of 5 steps; a scripted controller leaves rank 2 out at the end of epoch 0 (and,
with WHEN ``after_probe``, takes it back at the end of epoch 1). In epoch 1 rank LEAVER
leaves its loop, WHEN:
  mid          ``balancer.stop("loss is nan")`` and a break after its step 2;
  last         the same before the backward of the epoch's last step;
  before       the same before the forward of step 0;
  probe_stop   (rank 2) the same in its probe step, before ``step()``;
  probe_break  (rank 2) a plain break in its probe step, before ``step()``;
  after_probe  (rank 2) the same after its probe's ``step()``;
  top          the same after ``set_epoch(1)``, before the loop;
  peek         (rank 2) no leave: it takes the loader's first batch for a look first.
Every rank's epoch loop ends once ``balancer.stopped`` says so. With ``syncbn``, hvd_balance's
SyncBatchNorm (its sums, and DDP's broadcast of its buffers at every forward). Each rank emits
its steps per epoch, ``LoadBalancer.stopped`` and its loop's seconds, then all meet in a
barrier (the groups must still be in step).
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
leaver, when = int(sys.argv[1]), sys.argv[2]
x, y, _, model = exactness_job(5 * 12 + 3, "syncbn" in sys.argv[3:])
dataset = TensorDataset(x, y)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
windows = []


class Scripted:
    def next(self, plan, window):
        windows.append(1)
        back = when == "after_probe" and len(windows) > 1
        return Decision(hb.Plan.from_batch_sizes([4, 4, 4] if back else [8, 4, 0]), "switched",
                        0.001, window.step_s, 0.0), self


def leaves(epoch, step, moment):
    if epoch != 1 or rank != leaver:
        return False
    at = {"mid": ("after", 2), "last": ("backward", 4), "before": ("forward", 0),
          "probe_stop": ("after_forward", 0), "probe_break": ("after_forward", 0),
          "after_probe": ("after", 0)}.get(when)
    return at == (moment, step)


sampler = hb.BalancedBatchSampler(dataset, global_batch_size=12, seed=3)
balancer = hb.LoadBalancer(model, sampler, optimizer=opt, controller=Scripted(), verbose=0)
steps, start = [], time.monotonic()
for epoch in range(3):
    sampler.set_epoch(epoch)
    steps.append(0)
    if epoch == 1 and rank == leaver and when == "top":
        balancer.stop("loss is nan")
        break
    if epoch == 1 and rank == leaver and when == "peek":
        next(iter(DataLoader(dataset, batch_sampler=sampler)))
    for step, (xb, yb) in enumerate(DataLoader(dataset, batch_sampler=sampler)):
        if leaves(epoch, step, "forward"):
            balancer.stop("loss is nan")
            break
        loss = nn.functional.cross_entropy(model(xb), yb)
        if leaves(epoch, step, "after_forward") or leaves(epoch, step, "backward"):
            if when != "probe_break":
                balancer.stop("loss is nan")
            break
        opt.zero_grad()
        balancer.scale(loss).backward()
        opt.step()
        balancer.step()
        steps[-1] += 1
        if leaves(epoch, step, "after"):
            balancer.stop("loss is nan")
            break
    if balancer.stopped:
        break
emit({"rank": rank, "steps": steps, "stopped": balancer.stopped,
      "seconds": time.monotonic() - start})
finish()

"""A rank left out for an epoch and taken back, against one process on the global batch.

Usage: torchrun --nproc-per-node N leave_out_exact.py [syncbn]
Float64, 3 epochs of 5 steps, B = 4 N, SGD with momentum and an LR scheduler stepped every
batch (so the optimizer's and the scheduler's state a rank taken back receives matter). A scripted controller leaves the last rank out at the end of
epoch 0 and takes it back at the end of epoch 1 (the LoadBalancer with ``optimizer=``);
every rank records each step's local batch (its sample indices) and, at the end, the
largest relative difference of its weights from a copy of the initial model trained in the
same process on each step's whole global batch.
"""
import sys

from _common import emit, exactness_job, finish, init

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb
from hvd_balance.core.controller import Decision

EPOCHS, STEPS = 3, 5
torch.set_default_dtype(torch.float64)
rank, size = init()
syncbn = "syncbn" in sys.argv[1:]
B = 4 * size
x, y, reference, model = exactness_job(STEPS * B + 3, syncbn)
dataset = TensorDataset(x, y, torch.arange(len(x)))
opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)


def decay(step):  # a closed form of the step count: wrong on a rank that missed the steps
    return 1.0 / (1.0 + 0.1 * step)


schedule = torch.optim.lr_scheduler.LambdaLR(opt, decay)
loss_fn = nn.CrossEntropyLoss()
windows = []


class Scripted:
    """Epoch 0's end: the last rank out (its samples to rank 0); epoch 1's end: back."""

    def next(self, plan, window):
        windows.append({"batches": list(window.batch_sizes), "left_out": list(window.left_out),
                        "may_leave_out": window.may_leave_out})
        sizes = [4] * size
        if len(windows) == 1:
            sizes = [8] + [4] * (size - 2) + [0]
        return Decision(hb.Plan.from_batch_sizes(sizes), "switched", 0.001, window.step_s,
                        0.0), self


sampler = hb.BalancedBatchSampler(dataset, global_batch_size=B, seed=3)
balancer = hb.LoadBalancer(model, sampler, optimizer=opt, controller=Scripted(),
                           rebalance="epoch", stateful=[schedule])
loader = DataLoader(dataset, batch_sampler=sampler)
steps = []
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for xb, yb, idx in loader:
        steps.append({"epoch": epoch, "indices": idx.tolist(), "weight": balancer.weight,
                      "left_out": balancer.plan.batch_sizes[rank] == 0})
        opt.zero_grad()
        balancer.scale(loss_fn(model(xb), yb)).backward()
        opt.step()
        schedule.step()
        balancer.step()

ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, decay)
for epoch in range(EPOCHS):
    order = sampler.order(epoch)
    for step in range(STEPS):
        index = order[step * B:(step + 1) * B]
        ref_opt.zero_grad()
        loss_fn(reference(x[index]), y[index]).backward()
        ref_opt.step()
        ref_schedule.step()
pairs = zip(model.module.state_dict().values(), reference.state_dict().values())
relative = max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))
               for a, b in pairs)
emit({"rank": rank, "relative": relative, "steps": steps, "windows": windows, "B": B,
      "probe_batch": sampler.probe_batch,
      "history": [h["batch_sizes"] for h in balancer.history]})
finish()

"""A rank left out for an epoch and taken back, against one process on the global batch.

Usage: torchrun --nproc-per-node N leave_out_exact.py [syncbn] [slow] [nostateful]
       [log_default|log_training_group]
Float64, 3 epochs of 5 steps, B = 4 N, SGD with momentum and an LR scheduler stepped every
batch (so the optimizer's and the scheduler's state a rank taken back receives matter). A scripted controller leaves the last rank out at the end of
epoch 0 and takes it back at the end of epoch 1 (the LoadBalancer with ``optimizer=``);
every rank records each step's local batch (its sample indices) and, at the end, the
largest relative difference of its weights from a copy of the initial model trained in the
same process on each step's whole global batch.
``slow``: every step also sleeps 0.8 s (an epoch longer than a 3 s group timeout);
``nostateful``: the scheduler is not passed in ``stateful=`` (the leave is refused);
``log_*``: the loop all-reduces its summed loss and sample count after each step, on the
default group or on ``hb.training_group()``. An error is emitted as ``{"rank", "error"}``.
"""
import os
import time
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
slow, stateful = "slow" in sys.argv[1:], "nostateful" not in sys.argv[1:]
log = next((a[4:] for a in sys.argv[1:] if a.startswith("log_")), None)
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
                           rebalance="epoch", stateful=[schedule] if stateful else [])
loader = DataLoader(dataset, batch_sampler=sampler)
steps, epoch_s, logged_counts = [], [], []
try:
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for xb, yb, idx in loader:
            steps.append({"epoch": epoch, "indices": idx.tolist(), "weight": balancer.weight,
                          "left_out": balancer.plan.batch_sizes[rank] == 0})
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            balancer.scale(loss).backward()
            opt.step()
            schedule.step()
            if slow:
                time.sleep(0.8)
            if log is not None:
                logged = torch.stack([loss.detach() * len(xb), torch.tensor(float(len(xb)))])
                group = hb.training_group() if log == "training_group" else None
                if log == "default" or hb.training_ranks().count(rank):
                    torch.distributed.all_reduce(logged, group=group)
                    logged_counts.append(int(logged[1]))
            balancer.step()
        epoch_s.append(time.perf_counter() - start)
except Exception as err:  # noqa: BLE001 - the test reads every rank's error
    emit({"rank": rank, "error": f"{type(err).__name__}: {err}"})
    sys.stdout.flush()
    time.sleep(2)  # the others reach their error too before torchrun ends the job
    os._exit(1)  # no barrier: a rank may be in the middle of an epoch

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
      "probe_batch": sampler.probe_batch, "epoch_s": epoch_s, "logged_counts": logged_counts,
      "history": [h["batch_sizes"] for h in balancer.history]})
finish()

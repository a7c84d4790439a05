"""An FSDP2 job where rank 1 leaves its loop mid-epoch: the others finish the step with its shard.

Usage: torchrun --nproc-per-node 2 fsdp_stop.py WHERE
Float64, B = 10 ([4, 6]), two blocks sharded, then the root. At step 3 rank 1 leaves:
``boundary``: before the step's forward (``balancer.stop(...)``, then ``break``);
``after_forward``: after computing its loss (a NaN check's place), before backward. Rank 0
records its step-3 loss (if the note did not stop it first, at the boundary), which it
computes with parameters all-gathered from both shards,
and a reference model trained in the same process on the first 3 global batches gives the
loss on the same samples. Every rank emits the steps it ran, both losses and its stopped.
"""
import copy
import sys

from _common import emit, finish, init

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb

rank, size = init()
where = sys.argv[1]
torch.set_default_dtype(torch.float64)
B, LEAVE = 10, 3
torch.manual_seed(0)
x = torch.randn(8 * B, 6)
y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
reference = nn.Sequential(nn.Sequential(nn.Linear(6, 16), nn.Tanh()),
                          nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 2))
model = copy.deepcopy(reference)
for block in (model[0], model[1]):
    fully_shard(block)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.3)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3)
dataset = TensorDataset(x, y)
sampler = hb.BalancedBatchSampler(dataset, global_batch_size=B, seed=1)
balancer = hb.LoadBalancer(model, sampler, plan=hb.Plan.from_batch_sizes([4, 6]), verbose=0)
loss_fn = nn.CrossEntropyLoss()
steps, losses = 0, {}
for step, (xb, yb) in enumerate(DataLoader(dataset, batch_sampler=sampler)):
    if rank == 1 and step == LEAVE and where == "boundary":
        balancer.stop("leaving at the boundary")
        break
    opt.zero_grad()
    loss = loss_fn(model(xb), yb)
    if rank == 1 and step == LEAVE:
        balancer.stop("its loss was looked at")
        break
    if step == LEAVE:
        losses["sharded"] = loss.item()
        with torch.no_grad():
            losses["reference"] = loss_fn(reference(xb), yb).item()
    balancer.scale(loss).backward()
    opt.step()
    balancer.step()
    steps += 1
    if step < LEAVE:  # the reference takes the whole global batch of each step both ranks ran
        index = sampler.order(0)[step * B:(step + 1) * B]
        ref_opt.zero_grad()
        loss_fn(reference(x[index]), y[index]).backward()
        ref_opt.step()
# A rank that left after its forward holds the root's parameters unsharded (FSDP2 keeps them
# so for the backward that did not come): local values either way.
local = [p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p
         for p in model.parameters()]
emit({"rank": rank, "steps": steps, "losses": losses, "stopped": balancer.stopped,
      "finite": all(bool(torch.isfinite(t).all()) for t in local)})
finish()

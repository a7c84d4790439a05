"""An FSDP2 model under the balancer against one process on the global batch.

Usage: torchrun --nproc-per-node N fsdp_exact.py MODE
MODE ``exact``: float64, two blocks and a head, each block sharded with ``fully_shard`` and
then the root; AdamW, a per-batch LR scheduler, ``clip_grad_norm_`` over the DTensors (it
binds); a scripted controller switches the plan every 2 steps, within the epoch, through
uneven plans. A copy of the initial model trains in the same process on each step's whole
global batch, clipped and scheduled alike; every rank emits the largest relative
difference of the full parameters after each step, each step's local batch and the
gradient norms. MODE ``bf16,P`` / ``fp32,P``: float32, the plan ``P`` (``3,7``) kept, with a
``MixedPrecisionPolicy`` of bf16 parameters and fp32 reduction (or none); the relative
difference of the whole parameter vector, against the float32 reference.
"""
import copy
import sys

from _common import emit, finish, init

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb
from hvd_balance.core.controller import Decision

rank, size = init()
mode = sys.argv[1]
exact = mode == "exact"
torch.set_default_dtype(torch.float64 if exact else torch.float32)
PLANS = {2: [[3, 7], [6, 4], [1, 9]], 3: [[3, 7, 2], [5, 1, 6], [2, 2, 8]]}[size]
given = [int(b) for b in mode.split(",")[1:]] or PLANS[0]
B = sum(given)
STEPS = 6
torch.manual_seed(0)
x = torch.randn(STEPS * B + 3, 6)
y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()


def block(n_in, n_out):
    return nn.Sequential(nn.Linear(n_in, n_out), nn.Tanh())


reference = nn.Sequential(block(6, 16), block(16, 16), nn.Linear(16, 2))
model = copy.deepcopy(reference)
policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mode.startswith("bf16") else MixedPrecisionPolicy())
for blk in (model[0], model[1]):
    fully_shard(blk, mp_policy=policy)
fully_shard(model, mp_policy=policy)

opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.01)
schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s))
ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1.0 + 0.2 * s))
loss_fn = nn.CrossEntropyLoss()
MAX_NORM = 0.3  # below the first steps' norms: the clipping binds


class Scripted:
    """At each window (every 2 steps) the next of PLANS, applied within the epoch."""

    def __init__(self):
        self.windows = 0

    def next(self, plan, window):
        self.windows += 1
        sizes = PLANS[self.windows % len(PLANS)]
        return Decision(hb.Plan.from_batch_sizes(sizes), "switched", 0.001, window.step_s,
                        0.0), self


dataset = TensorDataset(x, y)
sampler = hb.BalancedBatchSampler(dataset, global_batch_size=B, seed=3)
balancer = (hb.LoadBalancer(model, sampler, plan=hb.Plan.from_batch_sizes(given), rebalance=2,
                            controller=Scripted(), optimizer=opt, verbose=0) if exact else
            hb.LoadBalancer(model, sampler, plan=hb.Plan.from_batch_sizes(given), verbose=0))
loader = DataLoader(dataset, batch_sampler=sampler)


def largest_difference():
    """Exact: the largest element-wise relative difference; else over the whole parameter
    vector, ||p - p_ref|| / ||p_ref|| (bf16's rounding is relative to the larger weights)."""
    full = [p.full_tensor().double() for p in model.parameters()]
    ref = [p.detach().double() for p in reference.parameters()]
    if not exact:
        return float(torch.cat([(a - b).flatten() for a, b in zip(full, ref)]).norm()
                     / torch.cat([b.flatten() for b in ref]).norm())
    return max(float(((a - b).abs() / (b.abs() + 1e-3)).max()) for a, b in zip(full, ref))


diffs, local, norms, plans = [], [], [], []
for step, (xb, yb) in enumerate(loader):
    local.append(len(xb))
    plans.append(list(balancer.plan.batch_sizes))
    opt.zero_grad()
    balancer.scale(loss_fn(model(xb), yb)).backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
    opt.step()
    schedule.step()
    balancer.step()
    index = sampler.order(0)[step * B:(step + 1) * B]
    ref_opt.zero_grad()
    loss_fn(reference(x[index]), y[index]).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
    ref_opt.step()
    ref_schedule.step()
    norms[-1] = [norms[-1], ref_norm]
    diffs.append(largest_difference())
emit({"rank": rank, "diffs": diffs, "local_batches": local, "plans": plans, "norms": norms})
finish()

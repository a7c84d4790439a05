"""One rank leaves its loop in the middle of epoch 0; it lives on and writes its result.

Usage: torchrun --nproc-per-node 2 early_stop.py MODE [MODEL [LEAVER]]
  stop     rank LEAVER calls balancer.stop("loss is nan") then breaks after step 5 (6 steps done).
  break    rank LEAVER breaks after step 5, no reason given.
  normal   no rank leaves (2 epochs of 24 steps).
MODEL: mlp (no buffers, default), bn1d (nn.BatchNorm1d), bn2d (a convolution and
nn.BatchNorm2d) or syncbn (bn1d through hvd_balance's convert_sync_batchnorm); DDP keeps its
default broadcast of buffers at every forward. LEAVER: 1 (default) or 0 (the broadcast's root).
Each rank emits {"rank", "steps" (per epoch), "stopped", "seconds" (its loop's), "after",
"batches_tracked" (its batch norm's num_batches_tracked: the root's count broadcast at each
forward, plus one: the steps this rank ran)}, then both ranks meet in a barrier (the groups
must still be in step).
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
kind = sys.argv[2] if len(sys.argv) > 2 else "mlp"
leaver = int(sys.argv[3]) if len(sys.argv) > 3 else 1
torch.manual_seed(0)
x = torch.randn(1536, 32)
y = (x[:, 0] > 0).long()
data = TensorDataset(x, y)
if kind == "bn2d":  # each sample as a 2-channel 4x4 image
    net = nn.Sequential(nn.Unflatten(1, (2, 4, 4)), nn.Conv2d(2, 4, 3, padding=1),
                        nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
elif kind in ("bn1d", "syncbn"):
    net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))
else:
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
if kind == "syncbn":
    net = hb.convert_sync_batchnorm(net)
model = DDP(net)
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
        if mode in ("stop", "break") and rank == leaver and epoch == 0 and step == 5:
            if mode == "stop":
                balancer.stop("loss is nan")
            break
    steps.append(done)
    if balancer.stopped:
        break
seconds = time.monotonic() - start
norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
emit({"rank": rank, "steps": steps, "stopped": balancer.stopped, "seconds": seconds,
      "after": "alive", "batches_tracked": int(norms[0].num_batches_tracked) if norms else None})
finish()

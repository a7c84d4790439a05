"""One rank on each of two hosts (the namespace cluster), torchrun's c10d rendezvous.

Usage: two_hosts.py cut|flood FOLDER   ($HVD_BALANCE_LOST_S set by the test)

- ``cut``: trains until stopped, 20 ms a step; after 20 steps each rank writes its pid to
  FOLDER/pid<rank> and rank 0 writes FOLDER/ready, and the test then cuts hostB's link. Both
  ranks must exit, non-zero, naming the other.
- ``flood``: each rank writes FOLDER/ports<rank>.json, its channels' UDP endpoints, after 10
  steps; once FOLDER/flooding exists (a stranger floods those ports for 10 s), rank 1 trains
  40 steps more and stops its loop (``balancer.stop``). Each rank emits the step it stopped
  after, the stop it heard, its channels' dropped datagrams, and its median step (seconds)
  before and during the flood.
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import emit, finish, init

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb
from hvd_balance.torch import membership, stop

MODE, FOLDER = sys.argv[1], Path(sys.argv[2])
rank, size = init()
torch.manual_seed(0)
x = torch.randn(4096, 32)
data = TensorDataset(x, (x[:, 0] > 0).long())
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sampler = hb.BalancedBatchSampler(data, global_batch_size=32, seed=0)
balancer = hb.LoadBalancer(model, sampler, verbose=0)
channels = [membership.current().heartbeat.channel, stop.open_board().channel]
steps, before, during, flood_step = 0, [], [], None
for epoch in range(10 ** 6):
    sampler.set_epoch(epoch)
    for xb, yb in DataLoader(data, batch_sampler=sampler):
        began = time.perf_counter()
        opt.zero_grad()
        balancer.scale(nn.functional.cross_entropy(model(xb), yb)).backward()
        opt.step()
        balancer.step()
        steps += 1
        time.sleep(0.02)
        (during if flood_step is not None else before).append(time.perf_counter() - began)
        if MODE == "cut" and steps == 20:
            (FOLDER / f"pid{rank}").write_text(str(os.getpid()))
            if rank == 0:
                (FOLDER / "ready").write_text("")
        if MODE == "flood" and steps == 10:
            ports = [list(s.getsockname()) for c in channels for s in c.routes.values()]
            (FOLDER / f"ports{rank}.json").write_text(json.dumps(ports))
        if flood_step is None and (FOLDER / "flooding").exists():
            flood_step = steps
        if MODE == "flood" and rank == 1 and flood_step is not None and steps == flood_step + 40:
            balancer.stop("a test stops here")
            break
    if balancer.stopped:
        break
emit({"rank": rank, "steps": steps, "stopped": balancer.stopped,
      "dropped": sum(c.dropped for c in channels),
      "transports": sorted({t for c in channels for t in c.transports.values()}),
      "step_before_s": statistics.median(before[-50:]),
      "step_during_s": statistics.median(during) if during else None})
finish()

"""What both parts of the device check run: the model, its data and the timed training jobs.

Imported by ``device_check.py`` (part gpu) and ``device_check_cpu.py`` (parts cpu and fsdp),
which import nothing of each other's.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hvd_balance.torch as hb  # noqa: E402

GROUP_TIMEOUT_S = 240  # a collective waits this long for a stuck rank before failing


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


def resnet(width: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         Block(width, width, 1), Block(width, 2 * width, 2),
                         Block(2 * width, 2 * width, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2 * width, 10))


def make_data(n: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = (x[:, 0].mean((1, 2)) * 7).long().remainder(10)
    return TensorDataset(x, y)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rate(device, cfg, batch):
    """This rank's samples/s on its own (no collectives) at ``batch`` samples."""
    torch.manual_seed(0)
    model = resnet(cfg["width"]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.zeros(batch, dtype=torch.long, device=device)
    times = []
    for i in range(cfg["rate_repeats"] + 2):
        sync(device)
        t = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sync(device)
        if i >= 2:  # two warm-up steps (cuDNN's algorithm search, allocations)
            times.append(time.perf_counter() - t)
    times.sort()
    return batch / times[len(times) // 2]


def shard(model: nn.Module) -> nn.Module:
    """``model`` sharded with FSDP2's ``fully_shard``: each residual block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, Block):
            fully_shard(layer)
    return fully_shard(model)


def train(rank, device, cfg, plan=None, epochs=1, rebalance="off", alone=False, sync_bn=True):
    """Epoch wall seconds (between barriers, as rank 0 sees them) and the plans used;
    ``sync_bn``: hvd_balance's SyncBatchNorm (a collective per layer), else torch's own;
    ``cfg["sharded"]``: FSDP2 (:func:`shard`) in place of DDP."""
    data = make_data(cfg["steps"] * cfg["global_batch"])
    torch.manual_seed(0)
    model = resnet(cfg["width"])
    if not alone and sync_bn:
        model = hb.convert_sync_batchnorm(model)
    model = model.to(device)
    if alone:
        loader = DataLoader(data, batch_size=cfg["global_batch"], shuffle=True, drop_last=True)
        step_model, balancer = model, None
    else:
        step_model = shard(model) if cfg.get("sharded") else DDP(model)
    opt = torch.optim.SGD(step_model.parameters(), lr=0.05, momentum=0.9)
    if not alone:  # optimizer=: it may leave ranks out (issue 40), or advise under FSDP2
        sampler = hb.BalancedBatchSampler(data, global_batch_size=cfg["global_batch"], seed=0)
        balancer = hb.LoadBalancer(step_model, sampler, plan=plan, rebalance=rebalance,
                                   verbose=0, optimizer=opt)
        loader = DataLoader(data, batch_sampler=sampler)
    epoch_s, plans = [], []
    for epoch in range(epochs):
        if balancer is not None:
            sampler.set_epoch(epoch)
            plans.append(list(balancer.plan.batch_sizes))
        if not alone:
            dist.barrier()
        start = time.perf_counter()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = F.cross_entropy(step_model(x), y)
            (balancer.scale(loss) if balancer else loss).backward()
            opt.step()
            if balancer:
                balancer.step()
        sync(device)
        if not alone:
            dist.barrier()
        epoch_s.append(time.perf_counter() - start)
    out = {"epoch_s": epoch_s, "plans": plans}
    if balancer is not None:
        out["final_plan"] = list(balancer.plan.batch_sizes)
        out["left_out"] = [i for i, b in enumerate(out["final_plan"]) if b == 0]
        out["history"] = [{k: h[k] for k in ("epoch", "step", "batch_sizes", "busy_ms", "step_ms",
                                             "decision")} for h in balancer.history]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""A plain DDP training script made balanced (docs/torch.md shows the diff: 6 lines).

    torchrun --standalone --nproc-per-node 2 examples/torch_ddp.py

Synthetic data (a linear rule on 20 features), an MLP, 3 epochs on CPU with Gloo.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb

dist.init_process_group("gloo")
torch.manual_seed(0)
x = torch.randn(4096, 20)
y = (x @ torch.linspace(-1, 1, 20) > 0).long()
dataset = TensorDataset(x, y)
global_batch = 128

sampler = hb.BalancedBatchSampler(dataset, global_batch_size=global_batch, seed=0)
loader = DataLoader(dataset, batch_sampler=sampler)
model = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
balancer = hb.LoadBalancer(model, sampler, optimizer=optimizer)  # may leave a costly rank out
loss_fn = nn.CrossEntropyLoss()

for epoch in range(3):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = balancer.scale(loss_fn(model(xb), yb))
        loss.backward()
        optimizer.step()
        balancer.step()
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: loss {loss.item() / balancer.weight:.4f}, "
              f"local batches {list(balancer.plan.batch_sizes)}", flush=True)
hb.end_job()  # barrier, group down, exit: torch 2.13's Gloo can abort a plain exit

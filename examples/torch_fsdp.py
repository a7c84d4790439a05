"""A plain FSDP2 training script made balanced (docs/fsdp.md shows the diff: 6 lines).

    torchrun --standalone --nproc-per-node 2 examples/torch_fsdp.py

A small transformer (an embedding, two ``nn.TransformerEncoderLayer`` blocks, a head), each
block sharded with ``fully_shard`` and then the root, as FSDP2's docs do; synthetic token
sequences, 3 epochs on CPU with Gloo ("nccl" and ``model.to(device)`` first on GPUs). On a
24 GB card beside a 32 GB one, ``max_batch_size={"3090": 48, "V100": 64}`` keeps each card's
local batch within its memory.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb


class Classifier(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.0,
                                       batch_first=True) for _ in range(layers))
        self.head = nn.Linear(width, 2)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


dist.init_process_group("gloo")
torch.manual_seed(0)
tokens = torch.randint(0, 64, (2048, 11))
labels = ((tokens < 32).sum(dim=1) > 5).long()  # whether most tokens are in the lower half
dataset = TensorDataset(tokens, labels)
global_batch = 64

sampler = hb.BalancedBatchSampler(dataset, global_batch_size=global_batch, seed=0)
loader = DataLoader(dataset, batch_sampler=sampler)
model = Classifier()
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
balancer = hb.LoadBalancer(model, sampler, optimizer=optimizer)
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

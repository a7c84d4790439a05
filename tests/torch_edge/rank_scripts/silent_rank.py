"""A rank that freezes ends the job; a long pause of one rank does not.

Usage: torchrun --nproc-per-node N silent_rank.py freeze|pause [lightning]
PyTorch's DDP tutorial's model and loop, balanced by the documented lines, with
``$HVD_BALANCE_LOST_S`` set by the test (a few seconds).

- ``freeze``: rank 1 stops itself with SIGSTOP at step 5 of epoch 0 (what a hung kernel, a
  stalled file system or a swapped-out host look like from outside), after starting a
  process that continues it 3 lost_s later (so torchrun's SIGTERM, pending meanwhile, ends
  it at once instead of its SIGKILL 30 s on). The others must exit, non-zero, naming it.
- ``pause``: rank 0 writes a checkpoint over and over for 3 lost_s after epoch 0 while the
  others wait in ``dist.barrier()``; every rank must train to the end. Each rank emits its
  epochs done.
- ``lightning``: the same in a Lightning ``Trainer`` with ``BalancedDDPStrategy``.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

from _common import emit, finish, init

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.torch as hb

MODE = sys.argv[1]
LIGHTNING = "lightning" in sys.argv[2:]
LOST_S = float(os.environ["HVD_BALANCE_LOST_S"])
EPOCHS, FREEZE_AT = 3, 5


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def freeze_here(rank):
    """SIGSTOP this process, SIGCONT it from a helper 3 lost_s later."""
    print(f"FROZEN rank {rank} at {time.time():.3f}", flush=True)
    subprocess.Popen(["sh", "-c", f"sleep {3 * LOST_S}; kill -CONT {os.getpid()}"],
                     start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def checkpoint_for(seconds, model):
    """Write the model to a file again and again for ``seconds`` (a large checkpoint)."""
    end = time.monotonic() + seconds
    with tempfile.TemporaryDirectory() as folder:
        while time.monotonic() < end:
            torch.save({"model": model.state_dict(), "pad": torch.randn(1 << 18)},
                       os.path.join(folder, "ckpt.pt"))


torch.manual_seed(0)
data = TensorDataset(torch.randn(480, 10), torch.randn(480, 5))

if LIGHTNING:
    import lightning as L

    import hvd_balance.lightning as hbl

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = ToyModel()

        def training_step(self, batch, batch_idx):
            if MODE == "freeze" and self.global_rank == 1 and batch_idx == FREEZE_AT:
                freeze_here(1)
            return nn.functional.mse_loss(self.model(batch[0]), batch[1])

        def on_train_epoch_end(self):
            if MODE == "pause" and self.current_epoch == 0:
                if self.global_rank == 0:
                    checkpoint_for(3 * LOST_S, self.model)
                self.trainer.strategy.barrier()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=hbl.BalancedDDPStrategy(process_group_backend="gloo", verbose=0),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(), DataLoader(data, batch_size=16, shuffle=True))
    emit({"rank": trainer.global_rank, "epochs": trainer.current_epoch})
    hbl.end_job()

rank, size = init()
model = nn.parallel.DistributedDataParallel(ToyModel())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
sampler = hb.BalancedBatchSampler(data, global_batch_size=16 * size, seed=0)
balancer = hb.LoadBalancer(model, sampler, optimizer=optimizer, verbose=0)
epochs = 0
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for step, (x, y) in enumerate(DataLoader(data, batch_sampler=sampler)):
        if MODE == "freeze" and rank == 1 and epoch == 0 and step == FREEZE_AT:
            freeze_here(rank)
        optimizer.zero_grad()
        balancer.scale(nn.functional.mse_loss(model(x), y)).backward()
        optimizer.step()
        balancer.step()
    if MODE == "pause" and epoch == 0:
        if rank == 0:
            checkpoint_for(3 * LOST_S, model.module)
        dist.barrier()
    epochs += 1
emit({"rank": rank, "epochs": epochs})
finish()

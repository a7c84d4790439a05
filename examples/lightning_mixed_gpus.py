"""A Lightning script made balanced: the lines marked ``# hvd_balance`` are all that changed
(docs/lightning.md shows the diff).

    python examples/lightning_mixed_gpus.py      # every GPU here (e.g. a 3090 and a 3060)
    python examples/lightning_mixed_gpus.py --accelerator cpu --devices 2
    torchrun --standalone --nproc-per-node 2 examples/lightning_mixed_gpus.py \
        --accelerator cpu --devices 2

Synthetic data (a linear rule on 20 features), an MLP with batch norm, 64 samples per device
and step as in Lightning's DDP (128 a step on 2 devices); each device's local batch follows its
speed, and on GPUs stays under what its memory holds (probed at the start).
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.lightning as hbl  # hvd_balance


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                 nn.Linear(64, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self(x).argmax(1) == y).double().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


parser = argparse.ArgumentParser()
parser.add_argument("--accelerator", default="auto")
parser.add_argument("--devices", default="auto")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

pl.seed_everything(0)
x = torch.randn(8192, 20)
y = (x @ torch.linspace(-1, 1, 20) > 0).long()
train = DataLoader(TensorDataset(x[:6144], y[:6144]), batch_size=64, shuffle=True)
val = DataLoader(TensorDataset(x[6144:], y[6144:]), batch_size=256)

strategy = hbl.BalancedDDPStrategy(max_batch_size="probe", probe_input=x[:1])  # hvd_balance
trainer = pl.Trainer(max_epochs=args.epochs, accelerator=args.accelerator, devices=args.devices,
                     strategy=strategy, sync_batchnorm=True, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Classifier(), train, val)
if trainer.is_global_zero:
    print(f"train_loss {float(trainer.callback_metrics['train_loss']):.4f}, "
          f"val_accuracy {float(trainer.callback_metrics['val_accuracy']):.4f}, "
          f"local batches {list(strategy.balancer.plan.batch_sizes)}", flush=True)
hbl.end_job()  # hvd_balance (optional): a clean exit, which torch 2.13's Gloo may abort

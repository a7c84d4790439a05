"""A Lightning Trainer with BalancedDDPStrategy against one process on the global batch.

Usage: torchrun --nproc-per-node N lightning_fit.py MODE [syncbn]
MODE: ``plan:B0,B1,...`` (a given uneven plan, no re-planning), ``caps:C0,C1,...`` (equal
start under memory caps, ``-`` for none, re-planning every 4 steps), ``slow:K`` (the last
rank sleeps 2 ms per sample of its batch: K times its compute or more; 12 steps an epoch,
re-planning every 4), ``switch:B0,B1,...`` (a controller that switches between equal
batches and this plan at every window, every 2 steps; validation twice an epoch, 2 loader
workers, and a second ``fit`` for a third epoch) or ``accumulate:K``
(``accumulate_grad_batches=K``, which the strategy refuses).
Every rank trains EPOCHS epochs in float64 (the loader's batch_size is per device, 6);
then, in the same process, a copy of the initial model trains on each step's whole global
batch (the sampler's permutation slices). Every rank emits the largest relative weight
difference, its local batches, the sample indices of each step, and the training loss
Lightning logged (on step and on epoch, ``sync_dist=True``) beside the one-process loss.
"""
import copy
import os
import sys
import time

from _common import emit, finish

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import hvd_balance.lightning as hbl
import hvd_balance.torch as hb
from hvd_balance.core.controller import Decision

mode, _, values = sys.argv[1].partition(":")
EPOCHS, PER_DEVICE, STEPS = 2, 6, 12 if mode in ("slow", "switch") else 5
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
syncbn = "syncbn" in sys.argv[2:]
size = int(os.environ["WORLD_SIZE"])
slowed = mode == "slow" and int(os.environ["RANK"]) == size - 1
B = PER_DEVICE * size
pl.seed_everything(7, verbose=False)
x = torch.randn(STEPS * B + 5, 6)
y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
dataset = TensorDataset(x, y, torch.arange(len(x)))


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), *([nn.BatchNorm1d(8)] if syncbn else []),
                                 nn.ReLU(), nn.Linear(8, 2))
        self.seen, self.local, self.step_losses, self.epoch_losses = [], [], [], []

    def forward(self, xb):
        return self.net(xb)

    def training_step(self, batch, batch_idx):
        xb, yb, idx = batch
        self.seen.append(idx.tolist())
        self.norm_in_fit = type(self.net[1]).__name__
        self.local.append(len(xb))
        loss = nn.functional.cross_entropy(self(xb), yb)
        if slowed:
            time.sleep(0.002 * len(xb))
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_losses.append(float(self.trainer.callback_metrics["train_loss_step"]))

    def on_train_epoch_start(self):  # the last epoch's, but not at a fit's start
        if self.current_epoch > 0 and "train_loss_epoch" in self.trainer.callback_metrics:
            self.epoch_losses.append(float(self.trainer.callback_metrics["train_loss_epoch"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


model = Net()
reference = copy.deepcopy(model.net)
if mode == "plan":
    kwargs = {"plan": hb.Plan.from_batch_sizes([int(b) for b in values.split(",")])}
elif mode == "accumulate":
    kwargs = {}
elif mode == "slow":
    kwargs = {"rebalance": 4}
elif mode == "switch":
    class Toggle:
        """Switches between equal batches and the given plan at every window."""

        def next(self, plan, window):
            other = [int(b) for b in values.split(",")]
            new = [B // size] * size if list(plan.batch_sizes) == other else other
            return Decision(plan=hb.Plan.from_batch_sizes(new), decision="switched",
                            predicted_s=None, measured_s=None, variation=0.0), self
    kwargs = {"rebalance": 2, "controller": Toggle()}
else:
    kwargs = {"max_batch_size": [None if c == "-" else int(c) for c in values.split(",")],
              "rebalance": 4}
# slow: a line a window on the console, and the windows' figures in a CSVLogger's file
strategy = hbl.BalancedDDPStrategy(verbose=2 if mode == "slow" else 0, **kwargs)
logs = os.environ.get("LIGHTNING_FIT_LOGS")
trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=size, strategy=strategy,
                     sync_batchnorm=syncbn,
                     logger=CSVLogger(logs, name="fit", version=0) if logs else False,
                     accumulate_grad_batches=int(values) if mode == "accumulate" else 1, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     val_check_interval=0.5 if mode == "switch" else 1.0)
loader = DataLoader(dataset, batch_size=PER_DEVICE, shuffle=True,
                    num_workers=2 if mode == "switch" else 0)
val = DataLoader(dataset, batch_size=16) if mode == "switch" else None
trainer.fit(model, loader, val)
model.epoch_losses.append(float(trainer.callback_metrics["train_loss_epoch"]))
fits = 1
if mode == "switch":  # a second fit (a new DDP model, new optimizer) for one more epoch
    first_balancer = strategy.balancer
    trainer.fit_loop.max_epochs = EPOCHS + 1
    trainer.fit(model, loader, val)
    model.epoch_losses.append(float(trainer.callback_metrics["train_loss_epoch"]))
    fits = 2
    assert strategy.balancer is not first_balancer

# One process on the same global batches.
sampler = strategy.balancer.sampler
opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
ref_step, ref_epoch = [], []
for epoch in range(EPOCHS + fits - 1):
    if epoch == EPOCHS:  # the second fit's new optimizer
        opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
    order = sampler.order(epoch)
    losses = []
    for step in range(sampler.steps):
        index = order[step * B:(step + 1) * B]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(reference(x[index]), y[index])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    ref_step += losses
    ref_epoch.append(sum(losses) / len(losses))

pairs = zip(model.net.state_dict().values(), reference.state_dict().values())
relative = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in pairs)
emit({"rank": trainer.global_rank, "relative": relative, "local": model.local,
      "seen": model.seen, "steps": sampler.steps, "B": sampler.global_batch_size,
      "epochs": EPOCHS + fits - 1, "seed": sampler.seed,
      "norms": [model.norm_in_fit, type(model.net[1]).__name__],
      "plans": [h["batch_sizes"] for h in strategy.balancer.history],
      "history": strategy.balancer.history,
      "caps": strategy.balancer.plan.max_batch_sizes,
      "step_losses": model.step_losses, "ref_step": ref_step,
      "epoch_losses": model.epoch_losses, "ref_epoch": ref_epoch})
finish()

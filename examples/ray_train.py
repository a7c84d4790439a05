"""Ray Train's ``TorchTrainer`` with hvd_balance.torch: the same lines in the per-worker loop.

    python examples/ray_train.py [--workers 2] [--slow-ms 0] [--epochs 4]

docs/ray.md shows the diff from a plain Ray Train loop. CPU workers, DDP from
``ray.train.torch.prepare_model``, the balancer's sampler instead of
``prepare_data_loader``'s (it shards the data itself); each epoch's
``ray.train.report`` carries the window's ``balance/...`` scalars beside the loss.
``--slow-ms`` makes the last worker wait that long every step, a device slower than the
others: the balancer gives it fewer samples, or leaves it out while it costs more than it
brings. Worker 0 also prints each epoch's metrics as a ``metrics: {...}`` JSON line.
"""

import argparse
import json
import time

import ray
import ray.train
import ray.train.torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer


def train_loop_per_worker(config):
    import json

    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    import hvd_balance.torch as hb
    from hvd_balance.core.run_record import scalars

    torch.manual_seed(0)
    x = torch.randn(4096, 20)
    y = (x @ torch.linspace(-1, 1, 20) > 0).long()
    dataset = TensorDataset(x, y)
    context = ray.train.get_context()
    slow = context.get_world_rank() == context.get_world_size() - 1 and config["slow_ms"] > 0

    sampler = hb.BalancedBatchSampler(dataset, global_batch_size=128, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(20, 64), nn.ReLU(),
                                                        nn.Linear(64, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    balancer = hb.LoadBalancer(model, sampler, optimizer=optimizer, verbose=0)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        total, seen = 0.0, 0
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            if slow:  # a slower device: its forward takes longer
                time.sleep(config["slow_ms"] / 1000)
            balancer.scale(loss).backward()
            optimizer.step()
            balancer.step()
            total, seen = total + loss.item() * len(xb), seen + len(xb)
        metrics = {"epoch": epoch, "loss": total / max(seen, 1),
                   "local_batches": list(balancer.plan.batch_sizes)}
        if balancer.lines:  # the last window's figures, named as in every logger
            metrics.update(scalars(balancer.lines[-1]))
        ray.train.report(metrics)
        if context.get_world_rank() == 0:
            print("metrics:", json.dumps(metrics), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    ray.init(num_cpus=args.workers, include_dashboard=False)
    trainer = TorchTrainer(train_loop_per_worker,
                           train_loop_config={"epochs": args.epochs, "slow_ms": args.slow_ms},
                           scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False))
    t = time.perf_counter()
    trainer.fit()
    print(f"trained in {time.perf_counter() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main()

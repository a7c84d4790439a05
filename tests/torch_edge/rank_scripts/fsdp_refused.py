"""What the balancer refuses of a sharded model, each case on every rank.

Usage: torchrun --nproc-per-node 2 fsdp_refused.py
Every rank emits, per case, the error's type and message (or None): FSDP1, blocks sharded
without the root, a 2-D mesh (HSDP), ``max_batch_size="probe"``, ``telemetry=``.
"""
from _common import emit, finish, init

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.utils.data import TensorDataset

import hvd_balance.torch as hb

rank, size = init()
dataset = TensorDataset(torch.randn(64, 4), torch.zeros(64, dtype=torch.long))


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 2))


def fsdp1():
    return FullyShardedDataParallel(net(), device_id=torch.device("cpu"))


def root_unsharded():
    model = net()
    fully_shard(model[0])
    return model


def hsdp():
    model = net()
    fully_shard(model, mesh=init_device_mesh("cpu", (1, size), mesh_dim_names=("rep", "shard")))
    return model


def sharded():
    model = net()
    fully_shard(model[0])
    fully_shard(model)
    return model


cases = {"fsdp1": (fsdp1, {}), "root_unsharded": (root_unsharded, {}), "hsdp": (hsdp, {}),
         "probe": (sharded, {"max_batch_size": "probe", "probe_input": torch.randn(1, 4)}),
         "telemetry": (sharded, {"telemetry": hb.StepTelemetry()})}
errors = {}
for name, (make, kwargs) in cases.items():
    sampler = hb.BalancedBatchSampler(dataset, global_batch_size=16, seed=0)
    try:
        hb.LoadBalancer(make(), sampler, verbose=0, **kwargs)
        errors[name] = None
    except Exception as err:  # noqa: BLE001 - the test reads the type and the message
        errors[name] = [type(err).__name__, str(err)]
emit({"rank": rank, "errors": errors})
finish()

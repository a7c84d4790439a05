"""What the torch rank scripts share: the result hand-over and the process group."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "rank_scripts"))  # _result

import _result  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

emit = _result.emit


def init():
    """The default group over Gloo (torchrun's environment), with the collective timeout
    ``$TEST_PG_TIMEOUT_S`` if set; returns (rank, world size)."""
    import datetime

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    timeout = os.environ.get("TEST_PG_TIMEOUT_S")
    dist.init_process_group("gloo", **({"timeout": datetime.timedelta(seconds=float(timeout))}
                                       if timeout else {}))
    return dist.get_rank(), dist.get_world_size()


def finish():
    """Leave the group cleanly, then the process at once: torch 2.13's Gloo threads can still
    be joinable when the interpreter tears down its modules, and the C++ runtime then aborts
    the process ("terminate called without an active exception", about one job in 14 here,
    with or without hvd_balance), which would fail a job whose results are all in."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exactness_job(samples: int, syncbn: bool):
    """The exactness jobs' inputs: ``samples`` rows of 6 features with a linear rule, and a small
    MLP twice, seeded: ``(x, y, reference, model)``, the reference for one process on the global
    batch, the model its copy in DDP (hvd_balance's SyncBatchNorm with ``syncbn``)."""
    import copy

    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_balance.torch as hb

    torch.manual_seed(0)
    x = torch.randn(samples, 6)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    layers = [nn.Linear(6, 8)] + ([nn.BatchNorm1d(8)] if syncbn else []) + [nn.ReLU(),
                                                                               nn.Linear(8, 2)]
    reference = nn.Sequential(*layers)
    model = copy.deepcopy(reference)
    return x, y, reference, DDP(hb.convert_sync_batchnorm(model) if syncbn else model)


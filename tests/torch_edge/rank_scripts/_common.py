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
    """The default group over Gloo (torchrun's environment); returns (rank, world size)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def finish():
    """Leave the group cleanly (without it Gloo's threads abort the process at exit)."""
    dist.barrier()
    dist.destroy_process_group()

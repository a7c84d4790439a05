"""The torch multi-rank helper: ranks under ``torchrun``, with `launch`'s hard timeout.

Usage::

    from support.torchrun import run_torchrun

    run = run_torchrun("tests/torch_edge/rank_scripts/exact_update.py", nproc=3, args=["5,1,10"])
    assert run.returncode == 0, run.stdout[-3000:]
    per_rank = run.results()   # {rank: what the script passed to _result.emit}

torchrun (``python -m torch.distributed.run --standalone``) starts the ranks on this machine
with a free rendezvous port; a run past ``timeout`` has its whole process group and every
process carrying the run's marker variable killed, and the test fails with the output.
When a rank fails, torchrun stops the others and prints a report naming it
(``rank: 1 (local_rank: 1)``, its exit code or signal).
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .launch import PYTHON, REPO, RESULTS_DIR_VAR, RUN_ID_VAR, Result, _run, rank_env

# Seconds between torchrun's checks of its ranks (its default is 0.1 in torch >= 2.3; set so
# a dead rank is noticed at once on every version).
MONITOR_INTERVAL_S = 0.5


def run_torchrun(script: str, nproc: int, timeout: float = 120,
                 env: Optional[Mapping[str, Optional[str]]] = None, args: Sequence[str] = (),
                 launcher_args: Sequence[str] = ()) -> Result:
    """Runs ``torchrun --standalone --nproc-per-node NPROC python SCRIPT ARGS`` from the
    repository; ``script`` is relative to it (or absolute). Returns `launch.Result`; a
    timeout fails the test after killing every rank."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--monitor-interval={MONITOR_INTERVAL_S}", *map(str, launcher_args),
           str(REPO / script), *map(str, args)]
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="rank_results_") as results_dir:
        result = _run(cmd, rank_env({RESULTS_DIR_VAR: results_dir, **(env or {}),
                                     RUN_ID_VAR: run_id}), timeout, run_id, emulated=False)
        result.result_files = {p.name: p.read_text()
                               for p in sorted(Path(results_dir).glob("rank*.json"))}
    return result


__all__ = ["run_torchrun", "MONITOR_INTERVAL_S"]

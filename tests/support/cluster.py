"""The namespace cluster for tests: hosts with sshd in network namespaces, and jobs on them.

Usage (tests/cluster/conftest.py gives the fixture ``cluster``: hostA and hostB)::

    from support.cluster import run_on

    run = run_on(cluster, "hostA", [HOROVODRUN, "-np", "4", "-H", "hostA:2,hostB:2", PYTHON,
                                    "tests/rank_scripts/balanced_fit.py", "audit"], timeout=300)
    assert run.returncode == 0 and run.results()[3]["plan"]["hosts"][3] == "hostB"

``run_on`` logs into the host through ssh (as a user on a cluster would) and runs the command
there under `run_ranks`'s hard timeout: past it the ssh client and every process carrying
the run's marker variable, on any host, are killed, and the test fails.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hvd_balance.tools import netns_cluster

from .launch import REPO, RESULTS_DIR_VAR, RUN_ID_VAR, Result, _run, rank_env

INSTALL = REPO / "scripts" / "cluster" / "install.sh"


def skip_reason() -> Optional[str]:
    """Why the cluster tests cannot run here (None when they can): they need root, and
    install what else they need with scripts/cluster/install.sh."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (network namespaces, sshd, cgroups)"
    install = subprocess.run(["bash", str(INSTALL)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    if install.returncode != 0:
        return f"scripts/cluster/install.sh failed: {install.stdout.strip()[-500:]}"
    missing = netns_cluster.missing_requirements()
    return f"the namespace cluster needs {', '.join(missing)}" if missing else None


def run_on(cluster: netns_cluster.NetnsCluster, host: str, cmd: Sequence[str],
           timeout: float, env: Optional[Mapping[str, Optional[str]]] = None) -> Result:
    """Runs ``cmd`` on ``host`` of ``cluster`` through ssh, from the repository, with
    `rank_env`'s variables plus ``env`` and a results folder for ``_result.emit``."""
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="rank_results_") as results_dir:
        job_env = rank_env({RESULTS_DIR_VAR: results_dir, **(env or {}), RUN_ID_VAR: run_id})
        ssh = cluster.ssh_command(host, host, [str(c) for c in cmd], job_env, cwd=str(REPO))
        result = _run(ssh, {**os.environ, RUN_ID_VAR: run_id}, timeout, run_id, emulated=False)
        result.result_files = {p.name: p.read_text()
                               for p in sorted(Path(results_dir).glob("rank*.json"))}
    return result


__all__ = ["INSTALL", "skip_reason", "run_on"]

"""scripts/demo.sh as a user who is not root: no cgroup quota can be set, so the demo runs
the compute-only ``--slowdown 1,4`` emulation instead, says so, and makes the same table and
chart."""

import json
import os

import pytest

from support import REPO, rank_env, run_command

NOBODY = 65534


@pytest.mark.timeout(420)
def test_the_demo_runs_without_root_on_the_slowdown_emulation(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    out, home = tmp_path / "results", tmp_path / "home"
    for folder in (out, home):
        folder.mkdir()
        os.chown(folder, NOBODY, NOBODY)
    # The venv's interpreter may live under root's home (pyenv), which another user cannot
    # reach: the user keeps the right to read and search files, nothing else (no cgroup, no
    # write outside its folders).
    user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    env = {**rank_env(), "HOME": str(home), "MPLCONFIGDIR": str(home),
           "HVD_BALANCE_DEMO_RESULTS": str(out)}
    # A user's checkout is theirs; CI's clone lies in a private temporary folder, where
    # access(2) (which drops capabilities) would not find horovodrun: let others pass through
    # its folder and those above it for the test's time.
    private = [p for p in (REPO, *REPO.parents) if not p.stat().st_mode & 0o001]
    modes = {p: p.stat().st_mode & 0o7777 for p in private}
    try:
        for p, mode in modes.items():
            os.chmod(p, mode | 0o001)
        run = run_command([*user, "bash", str(REPO / "scripts" / "demo.sh"), "--epochs", "2"],
                          env, timeout=360)
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "hvd_balance demo: no cgroup CPU quota here" in run.stdout
    assert "=== balanced: 2 ranks with rank 1's compute slowed 4x" in run.stdout
    rows = {r["strategy"]: r for r in json.loads((out / "demo.json").read_text())["rows"]}
    assert sorted(rows) == ["balanced", "proportional", "uniform"]
    assert rows["balanced"]["speedup"] > 1.3, rows  # the slowed rank got less work
    assert (out / "demo.png").stat().st_size > 10_000
    # the balanced run's record, summarized and drawn
    assert "hvd_balance run: keras, 2 ranks, global batch" in run.stdout
    assert (out / "demo-balanced.png").stat().st_size > 10_000

"""scripts/device_check.sh --cpu-only --tiny: every part runs here and writes its tables."""

import json
import sys

from support.launch import REPO, rank_env, run_command


def check_core_sets_part(out, part):
    """Part ``part``'s (cpu or fsdp) table and numbers, on the tiny 1, 1 cores."""
    result = json.loads((out / f"device_check_{part}.json").read_text())
    B = result["config"]["global_batch"]
    (row,) = result["rows"]
    assert row["cores"] == [1, 1] and "error" not in row, row
    rates = row["solo_samples_per_s"]
    assert len(rates) == 2 and min(rates) > 0
    assert abs(row["ideal_speedup"] - sum(rates) / max(rates)) < 1e-9
    for name, s in row["strategies"].items():
        assert sum(s["plan"]) == B, (name, s)
        assert s["samples_per_s"]["min"] <= s["samples_per_s"]["median"] <= s["samples_per_s"]["max"]
        assert abs(s["share_of_ideal"]["median"] * row["ideal_samples_per_s"]
                   - s["samples_per_s"]["median"]) < 1e-6 * s["samples_per_s"]["median"]
    assert 0 < row["strategies"]["load_balancer"]["efficiency"]["median"] <= 1
    table = (out / f"device_check_{part}.md").read_text()
    assert "| 1,1 |" in table and "LoadBalancer" in table and "paper's rule" in table
    assert "commit " in table.splitlines()[0] and "torch " in table.splitlines()[0]
    assert ("FSDP2" in table) == (part == "fsdp") and result["config"]["sharded"] == (part == "fsdp")


def test_every_part_runs_on_cpu_and_writes_its_tables(tmp_path):
    out = tmp_path / "out"
    run = run_command(["bash", REPO / "scripts" / "device_check.sh", "--part", "all", out,
                       "--cpu-only", "--tiny"], rank_env({"PYTHON": sys.executable}), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "device_check.json", "device_check.md", "device_check_cpu.json", "device_check_cpu.md",
        "device_check_fsdp.json", "device_check_fsdp.md"]
    for part in ("cpu", "fsdp"):
        check_core_sets_part(out, part)

    gpu = json.loads((out / "device_check.json").read_text())
    assert gpu["exact"]["exact"] is True and gpu["exact"]["max_diff"] <= 1e-4, gpu["exact"]
    for key in ("equal", "paper", "load_balancer", "equal_local_bn", "paper_local_bn",
                "load_balancer_local_bn"):
        assert "error" not in gpu[key] and gpu[key]["epoch_s"], (key, gpu[key])
        assert sum(gpu[key]["final_plan"]) == gpu["config"]["global_batch"]
        assert gpu[key]["left_out"] == [i for i, b in enumerate(gpu[key]["final_plan"]) if b == 0]
    lb = gpu["load_balancer"]
    assert lb["steady_s"] == sum(lb["epoch_s"][2:] or lb["epoch_s"][-1:]) / len(
        lb["epoch_s"][2:] or lb["epoch_s"][-1:])
    table = (out / "device_check.md").read_text()
    assert "| vs GPU alone | plan (local batches) | left out |" in table


def test_a_bad_part_is_refused_by_name():
    run = run_command(["bash", REPO / "scripts" / "device_check.sh", "--part", "tpu"],
                      rank_env({"PYTHON": sys.executable}), timeout=30)
    assert run.returncode == 2 and "--part tpu: use cpu, gpu, fsdp or all" in run.stdout

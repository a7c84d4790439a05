"""hvd_balance.tools.demo_report: the demo's side-by-side table, JSON and chart."""

import json
import subprocess
import sys

import pytest

from support import REPO
from hvd_balance.tools import demo_report


def _job(strategy, batches, epoch_s, val_accuracy, busy_ms, wait_ms):
    """A file as examples/train_digits.py --json writes it (two ranks, three epochs)."""
    history = {"loss": [1.0, 0.3, 0.1], "val_accuracy": val_accuracy}
    for i in range(2):
        history[f"balance/rank{i}/busy_ms"] = busy_ms[i]
        history[f"balance/rank{i}/wait_ms"] = wait_ms[i]
        history[f"balance/rank{i}/local_batch"] = [batches[i]] * 3
    return {"strategy": strategy, "world_size": 2,
            "plan": {"batch_sizes": batches, "global_batch_size": sum(batches)},
            "epoch_s": epoch_s, "history": history}


JOBS = {
    # The first epoch (graph building) is left out of every median.
    "uniform": _job("uniform", [256, 256], [30.0, 6.0, 6.4], [0.90, 0.98, 0.99],
                    busy_ms=[[99, 120, 130], [99, 540, 560]], wait_ms=[[9, 420, 440], [9, 5, 7]]),
    "balanced": _job("balanced", [410, 102], [20.0, 2.4, 2.6], [0.91, 0.98, 0.985],
                     busy_ms=[[99, 200, 210], [99, 220, 230]], wait_ms=[[9, 20, 30], [9, 2, 4]]),
    "proportional": _job("proportional", [400, 112], [21.0, 2.8, 3.0], [0.9, 0.97, 0.98],
                         busy_ms=[[99, 190, 200], [99, 250, 260]], wait_ms=[[9, 60, 70], [9, 1, 3]]),
}


@pytest.fixture
def job_files(tmp_path):
    paths = []
    for name in ("balanced", "uniform", "proportional"):  # any order in, fixed order out
        path = tmp_path / f"demo-{name}.json"
        path.write_text(json.dumps(JOBS[name]))
        paths.append(str(path))
    return paths


def test_rows_are_uniform_proportional_balanced_with_steady_epoch_medians_and_speedups():
    rows = demo_report.compare(list(JOBS.values()))
    assert [r["strategy"] for r in rows] == ["uniform", "proportional", "balanced"]
    uniform, proportional, balanced = rows
    assert uniform["epoch_s"] == pytest.approx(6.2)
    assert proportional["epoch_s"] == pytest.approx(2.9)
    assert balanced["epoch_s"] == pytest.approx(2.5)
    assert uniform["speedup"] == pytest.approx(1.0)
    assert proportional["speedup"] == pytest.approx(6.2 / 2.9)
    assert balanced["speedup"] == pytest.approx(6.2 / 2.5)
    assert balanced["local_batches"] == [410, 102]
    assert balanced["val_accuracy"] == pytest.approx(0.985)
    assert uniform["busy_ms"] == pytest.approx([125, 550])
    assert uniform["wait_ms"] == pytest.approx([430, 6])


def test_without_a_uniform_run_there_is_no_speedup_and_one_epoch_is_its_own_median():
    job = dict(JOBS["balanced"], epoch_s=[7.5])
    job["history"] = {"val_accuracy": [0.5]}
    (row,) = demo_report.compare([job])
    assert row["epoch_s"] == 7.5 and row["speedup"] is None
    assert row["busy_ms"] == [None, None]
    assert "-" in demo_report.table([row]).splitlines()[2].split()


def test_command_prints_the_table_and_writes_the_json_and_the_png(job_files, tmp_path):
    out_json, out_png = tmp_path / "out" / "demo.json", tmp_path / "out" / "demo.png"
    run = subprocess.run([sys.executable, "-m", "hvd_balance.tools.demo_report", *job_files,
                          "--shares", "1.0,0.25", "--json", str(out_json), "--png", str(out_png)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    lines = run.stdout.splitlines()
    assert lines[0].split() == ["strategy", "local", "batches", "epoch", "s", "speedup", "val",
                                "accuracy", "busy", "ms/step"]
    assert [line.split() for line in lines[2:]] == [
        ["uniform", "256,", "256", "6.20", "1.00x", "0.9900", "125", "/", "550"],
        ["proportional", "400,", "112", "2.90", "2.14x", "0.9800", "195", "/", "255"],
        ["balanced", "410,", "102", "2.50", "2.48x", "0.9850", "205", "/", "225"]]
    saved = json.loads(out_json.read_text())
    assert saved["shares"] == [1.0, 0.25]
    assert [r["strategy"] for r in saved["rows"]] == ["uniform", "proportional", "balanced"]
    assert saved["rows"][2]["speedup"] == pytest.approx(2.48)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out_png.stat().st_size > 10_000


def test_the_report_does_not_import_tensorflow(job_files, tmp_path):
    code = ("import sys; from hvd_balance.tools import demo_report; "
            f"demo_report.main({job_files!r} + ['--png', {str(tmp_path / 'c.png')!r}]); "
            "assert 'tensorflow' not in sys.modules and 'horovod' not in sys.modules")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr

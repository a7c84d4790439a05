"""The run's record: a job line, then a window line each, appended and flushed; read back with
a cut-short last line left out and anything else wrong named by its line."""
import json

import pytest

from hvd_balance.core import run_record
from hvd_balance.core.run_record import RunRecord, history_path, read_runs, window_line
from hvd_balance.core.window_record import record_decision, window_record

JOB = {"edge": "torch", "world_size": 2, "global_batch_size": 64, "hosts": ["a", "b"],
       "devices": ["cpu", "cpu"], "versions": {}}


def window(epoch=0, batches=(32, 32), busy=(0.016, 0.032)):
    r = window_record(epoch, 0, list(batches), list(busy), [0.016, 0.0], [0.032, 0.032],
                      [0.01, 0.01])
    return record_decision(r, "switched", 0.021, 0.02, (43, 21), None)


def test_the_path_is_the_argument_else_the_environment_else_none(monkeypatch, tmp_path):
    monkeypatch.delenv(run_record.ENV, raising=False)
    assert history_path(None) is None
    monkeypatch.setenv(run_record.ENV, str(tmp_path / "env.jsonl"))
    assert history_path(None) == str(tmp_path / "env.jsonl")
    assert history_path(tmp_path / "given.jsonl") == str(tmp_path / "given.jsonl")
    with pytest.raises(TypeError, match="history_file must be a path; got 3"):
        history_path(3)


def test_a_window_line_has_each_ranks_rate_and_the_ideal_step():
    line = window_line(window(), 64, ["a", "b"], ["cpu", "gpu"], now=5.0)
    assert [(r["host"], r["device"], r["local_batch"], r["samples_per_s"]) for r in line["ranks"]] \
        == [("a", "cpu", 32, 2000.0), ("b", "gpu", 32, 1000.0)]
    assert line["ideal_step_ms"] == pytest.approx(1e3 * 64 / 3000, abs=0.01)  # 21.33 ms
    assert line["share_of_ideal"] == pytest.approx(21.33 / 32, abs=1e-3)
    assert (line["decision"], line["predicted_ms"], line["next_batch_sizes"]) == \
        ("switched", 21.0, [43, 21])
    assert line["left_out"] == [] and line["time"] == 5.0


def test_a_rank_left_out_has_no_rate_and_the_ideal_counts_the_others():
    line = window_line(window(batches=(64, 0), busy=(0.032, 0.5)), 64)
    assert line["left_out"] == [1] and line["ranks"][1]["samples_per_s"] is None
    assert line["ideal_step_ms"] == pytest.approx(32.0) and line["ranks"][0]["host"] is None


def test_runs_appended_to_one_file_read_back_apart_and_a_cut_last_line_is_dropped(tmp_path):
    path = tmp_path / "run.jsonl"
    for windows in (2, 1):
        record = RunRecord(str(path))
        record.start(JOB)
        for epoch in range(windows):
            record.window(window_line(window(epoch), 64))
        record.close()
    with open(path, "a") as f:
        f.write(json.dumps({"record": "window", "epoch": 9})[:20])  # a crash mid-write
    runs = read_runs(str(path))
    assert [len(r["windows"]) for r in runs] == [2, 1]
    assert runs[0]["job"]["edge"] == "torch" and runs[0]["job"]["schema"] == run_record.SCHEMA
    assert [w["epoch"] for w in runs[0]["windows"]] == [0, 1]


def test_each_line_is_on_disk_once_written(tmp_path):
    path = tmp_path / "run.jsonl"
    record = RunRecord(str(path))
    record.start(JOB)
    record.window(window_line(window(), 64))
    assert len(path.read_text().splitlines()) == 2  # flushed, the file still open


@pytest.mark.parametrize("text, named", [
    ('{"record": "window"}\n', "line 1: expected a job or a window line after a job line"),
    ('{"record": "job", "global_batch_size": 1}\nnot json\n{"record": "job"}\n',
     "line 2: not a JSON line of a run record")])
def test_a_bad_line_is_named(tmp_path, text, named):
    path = tmp_path / "run.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=named):
        read_runs(str(path))


def test_a_folder_that_does_not_exist_fails_at_once(tmp_path):
    with pytest.raises(OSError):
        RunRecord(str(tmp_path / "missing" / "run.jsonl"))

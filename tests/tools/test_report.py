"""hvd-balance report: the summary and the picture of a run's record (hvd_balance.tools.report)."""

import json
import sys

import pytest

from hvd_balance.core.run_record import RunRecord, window_line
from hvd_balance.core.window_record import record_decision, window_record
from hvd_balance.tools import cli, report

pytestmark = pytest.mark.timeout(120)
JOB = {"edge": "torch", "world_size": 2, "global_batch_size": 64, "hosts": ["a", "b"],
       "devices": ["cpu", "cpu"], "versions": {}}


def write_run(path, cut=False):
    """Four windows: equal batches with rank 1 twice as slow, a switch to [43, 21], then kept;
    the last window leaves rank 1 out."""
    record = RunRecord(str(path))
    record.start(JOB)
    plans = [(32, 32), (43, 21), (43, 21), (64, 0)]
    for epoch, batches in enumerate(plans):
        busy = [b / 1000 for b in (batches[0], 2 * batches[1])]  # 1000 and 500 samples/s
        wait = [max(busy) - b for b in busy]
        w = window_record(epoch, 0, list(batches), busy, wait, [max(busy)] * 2, [0.01, 0.01])
        nxt = (43, 21) if epoch == 0 else batches
        record_decision(w, "switched" if epoch == 0 else "kept", max(busy), 0.02, list(nxt),
                        None)
        record.window(window_line(w, 64, JOB["hosts"], JOB["devices"], now=float(epoch)))
    record.close()
    if cut:
        with open(path, "a") as f:
            f.write('{"record": "window", "epo')  # a crash mid-write


def test_summary_holds_the_run_s_figures(tmp_path):
    path = tmp_path / "run.jsonl"
    write_run(path)
    s = report.summary(report.read_runs(str(path))[-1])
    assert (s["windows"], s["switches"], s["first_step_ms"], s["last_step_ms"]) == (4, 1, 64.0, 64.0)
    assert s["left_out"] == {1: 1} and s["last_batches"] == [64, 0]
    assert s["speedup_over_equal"] is None  # rank 1 has no rate while it is out
    second = report.summary({"job": JOB, "windows": report.read_runs(str(path))[-1]["windows"][:3]})
    # [43, 21] at 1000 and 500 samples/s: a step of 43 ms; equal batches take 32/500 s = 64 ms
    assert second["last_step_ms"] == 43.0 and second["speedup_over_equal"] == pytest.approx(1.49)
    assert second["share_of_ideal"] == pytest.approx(42.67 / 43.0, abs=1e-3)
    text = report.summary_text(second)
    assert "43.0 ms now" in text and "1.49x" in text and "left out" not in text
    assert "rank 1 was left out for 1 of 4 windows" in report.summary_text(s)


def test_the_cli_draws_a_png_and_an_html_page_from_a_file_cut_short(tmp_path, capsys):
    path, png, page = tmp_path / "run.jsonl", tmp_path / "r.png", tmp_path / "r.html"
    write_run(path, cut=True)
    assert cli.main(["report", str(path), "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "torch, 2 ranks, global batch 64, 4 windows, 1 plan changes" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert cli.main(["report", str(path), "--out", str(page)]) == 0
    text = page.read_text()
    assert "data:image/png;base64," in text and text.count("<tr>") == 5
    assert "<td>[43, 21]</td>" in text


@pytest.mark.parametrize("content, args, message", [
    ("", [], "holds no run"),
    (json.dumps({"record": "job", **JOB}) + "\n", ["--out", "x.png"], "no window yet"),
    (json.dumps({"record": "job", **JOB}) + "\n", ["--run", "3"], "--run 3: "),
    ('{"record": "window"}\n', [], "line 1: expected a job or a window line")])
def test_bad_records_and_options_are_named(tmp_path, capsys, content, args, message):
    path = tmp_path / "run.jsonl"
    path.write_text(content)
    assert cli.main(["report", str(path), *args]) == 1
    assert message in capsys.readouterr().err


def test_without_matplotlib_the_summary_prints_and_drawing_names_the_install(tmp_path, capsys,
                                                                           monkeypatch):
    path = tmp_path / "run.jsonl"
    write_run(path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert cli.main(["report", str(path), "--out", str(tmp_path / "r.png")]) == 1
    said = capsys.readouterr()
    assert "4 windows" in said.out and "pip install matplotlib" in said.err
    assert not (tmp_path / "r.png").exists()

"""Reading back the run record a real multi-rank job wrote (``HVD_BALANCE_HISTORY``), the
same schema from every edge."""
from hvd_balance.core.run_record import read_runs

ENV = "HVD_BALANCE_HISTORY"
JOB_KEYS = {"record", "schema", "time", "edge", "world_size", "global_batch_size", "hosts",
            "devices", "versions"}
WINDOW_KEYS = {"record", "time", "epoch", "step", "ranks", "step_ms", "predicted_ms", "decision",
               "variation", "efficiency", "left_out", "leave_out", "next_batch_sizes",
               "ideal_step_ms", "share_of_ideal"}
RANK_KEYS = {"rank", "host", "device", "local_batch", "busy_ms", "wait_ms", "samples_per_s"}


def windows_of(path, edge: str, world_size: int, global_batch_size: int) -> list:
    """The window lines of the one run in ``path``, after checking every line's fields, each
    window's ranks and batches, and the job's line."""
    runs = read_runs(str(path))
    assert len(runs) == 1, runs
    job, windows = runs[0]["job"], runs[0]["windows"]
    assert set(job) == JOB_KEYS, job
    assert (job["edge"], job["world_size"], job["global_batch_size"]) == \
        (edge, world_size, global_batch_size), job
    assert len(job["hosts"]) == len(job["devices"]) == world_size, job
    assert windows, job
    for w in windows:
        assert set(w) == WINDOW_KEYS, w
        assert [r["rank"] for r in w["ranks"]] == list(range(world_size)), w
        assert all(set(r) == RANK_KEYS for r in w["ranks"]), w
        assert sum(r["local_batch"] for r in w["ranks"]) == global_batch_size, w
        assert [r["host"] for r in w["ranks"]] == job["hosts"], w
        assert w["left_out"] == [r["rank"] for r in w["ranks"] if not r["local_batch"]], w
    times = [w["time"] for w in windows]
    assert times == sorted(times) and job["time"] <= times[0], times
    return windows


def board_scalars(log_dir, name: str) -> list:
    """The values of Keras's TensorBoard callback's epoch scalar ``name`` in ``log_dir`` (its
    ``train`` folder), read with TensorBoard's own event reader, in epoch order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    tag = f"epoch_{name}"
    if tag in events.Tags()["scalars"]:
        return [e.value for e in events.Scalars(tag)]
    return [float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]


def drawn(path, out) -> str:
    """``hvd-balance report`` on the record at ``path``: its summary, after checking that the
    picture it wrote to ``out`` is a PNG of some size."""
    import contextlib
    import io

    from hvd_balance.tools import cli

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert cli.main(["report", str(path), "--out", str(out)]) == 0
    with open(out, "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, len(png)
    return said.getvalue()

"""BalancedData's input sources on 2 real ranks (TFRecord files, tfds, a tf.data.Dataset):
equal steps, every rank parsing exactly its own records and every record once an epoch; bad
input refused on every rank, with the cause named, before any step and without a hang; a
record that fails to parse in the middle of an epoch stops every rank (hvd_balance.watchdog)."""
import os
import sys

import pytest

from support import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
import record_files as rf  # noqa: E402

SCRIPT = "tests/rank_scripts/sources_fit.py"
COUNTS = [37, 50, 13]  # 100 records: 6 steps of 16, 4 left out each epoch


@pytest.fixture()
def inputs(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    records = tmp_path / "records"
    rf.write_records(records, COUNTS)
    rf.write_records(records / "corrupt", [20])
    os.replace(records / "corrupt" / "part-0.tfrecord", records / "corrupt" / "bad.tfrecord")
    rf.corrupt_record(str(records / "corrupt" / "bad.tfrecord"), 11)
    rf.prepare_tfds(tmp_path / "tfds")
    return str(records), str(tmp_path / "tfds")


@pytest.mark.timeout(600)  # tf.data's sources: the same TensorFlow on the tf-keras stack
def test_every_source_gives_equal_steps_and_each_record_once_to_one_rank(inputs):
    run = run_ranks(SCRIPT, np=2, args=["cover", *inputs], timeout=540)
    assert run.returncode == 0, run.stdout[-4000:]
    per_rank = run.results()
    universes = {"tfrecords": set(range(100)), "dataset": set(range(100)),
                 "tfds": set(range(rf.TFDS_TRAIN))}
    for name, universe in universes.items():
        steps = len(universe) // 16
        got = [per_rank[r]["sources"][name] for r in (0, 1)]
        assert got[0]["steps"] == got[1]["steps"] == [steps, steps], name
        for epoch in range(2):
            ids = [g["ids"][epoch] for g in got]
            assert [len(i) for i in ids] == [steps * 5, steps * 11], name  # b_i a step, parsed once
            both = ids[0] + ids[1]
            assert len(set(both)) == len(both) == steps * 16 and set(both) <= universe, name
        assert got[0]["ids"][0] != got[0]["ids"][1], name  # a fresh shuffle each epoch
        if name != "dataset":  # read exactly its records, plus the one decoded at the start
            assert [g["records_read"] for g in got] == [2 * steps * 5 + 1, 2 * steps * 11 + 1]


@pytest.mark.timeout(420)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_a_record_failing_mid_epoch_on_one_rank_stops_every_rank(inputs, tmp_path):
    run = run_ranks(SCRIPT, np=2, args=["midway", *inputs], timeout=360,
                    env={"HVD_BALANCE_WATCHDOG_DIR": tmp_path / "watchdog"})
    assert run.returncode != 0 and "FINISHED" not in run.stdout, run.stdout[-4000:]
    assert "bad record id" in run.stdout, run.stdout[-4000:]
    assert not run.leftovers  # no rank outlived the launcher: none hung in the allreduce

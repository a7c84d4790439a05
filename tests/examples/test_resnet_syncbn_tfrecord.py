"""examples/resnet_syncbn_tfrecord.py runs as it stands on 2 ranks: it writes its TFRecord
files, trains the ResNet with SyncBatchNormalization from them, and every rank ends with the
same weights and moving statistics."""

import json
import math

import pytest

from support import run_ranks

EXAMPLE = "examples/resnet_syncbn_tfrecord.py"


@pytest.mark.timeout(300)
def test_resnet_example_writes_its_records_and_trains_from_them_on_two_ranks(tmp_path):
    records = tmp_path / "records"
    run = run_ranks(EXAMPLE, np=2, timeout=240, args=[
        "--make-data", records, "--train-records", 512, "--val-records", 128, "--epochs", 1,
        "--global-batch", 64, "--json", tmp_path / "out.json"])
    assert run.returncode == 0, run.stdout[-3000:]
    assert sorted(p.name for p in records.glob("*.tfrecord")) == \
        [f"train-0000{k}-of-00004.tfrecord" for k in range(4)] + ["val-00000-of-00001.tfrecord"]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world_size"] == 2 and len(out["local_batches"]) == 2
    assert sum(out["local_batches"]) == out["global_batch"] == 64, out["local_batches"]
    assert all(math.isfinite(out["history"][k][-1]) for k in ("loss", "val_loss")), out["history"]
    assert out["same_weights"] is True  # the moving statistics too: synchronized
    assert "local batches" in run.rank_lines(0)[-1]

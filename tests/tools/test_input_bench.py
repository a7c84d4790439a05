"""hvd_balance.tools.input_bench: the JPEG TFRecords it writes and its summary (no timing run)."""
import numpy as np
import pytest
import tensorflow as tf

from hvd_balance.tools import input_bench

pytestmark = pytest.mark.timeout(120)


def test_written_images_are_jpeg_records_with_labels(tmp_path):
    paths = input_bench.write_images(str(tmp_path), images=10, size=16, shards=3)
    assert len(paths) == 3
    features = {"jpeg": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    examples = [tf.io.parse_single_example(r, features) for r in tf.data.TFRecordDataset(paths)]
    assert len(examples) == 10
    assert sorted(int(e["label"]) for e in examples) == sorted(i % 10 for i in range(10))
    image = tf.io.decode_jpeg(examples[0]["jpeg"])
    assert image.shape == (16, 16, 3) and image.dtype == tf.uint8


def rank(mode, r, epoch_s, local, read):
    return {"mode": mode, "rank": r, "steps": 10, "epoch_s": epoch_s, "local_batch": [local] * 3,
            "bytes_read": [read * 1000] * 3, "records_read": [read] * 3,
            "own_samples": [local * 10] * 3, "read_amplification": [read / (local * 10)] * 3}


def test_summary_takes_the_slowest_rank_after_the_first_epoch_and_the_speedup():
    runs = [[rank("plain", 0, [9, 2.0, 2.2], 32, 640), rank("plain", 1, [9, 4.0, 4.4], 32, 640)],
            [rank("balanced", 0, [9, 1.0, 1.2], 52, 520), rank("balanced", 1, [9, 2.0, 2.0], 12, 120)]]
    summary = input_bench.summarise(runs, batch=64)
    assert summary["plain"]["epoch_s"] == pytest.approx(4.2)        # median of 4.0, 4.4
    assert summary["balanced"]["epoch_s"] == pytest.approx(2.0)
    assert summary["balanced"]["speedup"] == pytest.approx(2.1)
    assert summary["plain"]["samples_per_s"] == pytest.approx(640 / 4.2)
    assert [r["read_amplification"] for r in summary["plain"]["ranks"]] == [2.0, 2.0]
    assert [r["read_amplification"] for r in summary["balanced"]["ranks"]] == [1.0, 1.0]
    text = input_bench.table(summary)
    assert "| balanced | 52, 12 | 2.000 | 320 |" in text and "(2.00x)" in text

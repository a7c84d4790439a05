"""Small input data on disk for the input-source tests: TFRecord files and a tiny tfds builder.

Every record holds its global number ``id`` (0, 1, ... over the files in order), a float
feature ``2 * id`` and a label ``id % 10``, so a test reads back exactly which records a rank
got. Also importable by rank scripts (``sys.path`` + ``import record_files``).
"""

from __future__ import annotations

import os
from typing import List

import numpy as np
import tensorflow as tf

FEATURES = {"id": tf.io.FixedLenFeature([], tf.int64),
            "x": tf.io.FixedLenFeature([2], tf.float32),
            "label": tf.io.FixedLenFeature([], tf.int64)}


def example(i: int) -> bytes:
    feature = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
               "x": tf.train.Feature(float_list=tf.train.FloatList(value=[2.0 * i, 1.0])),
               "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 10]))}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_records(folder, counts) -> List[str]:
    """TFRecord files ``part-{k}.tfrecord`` with ``counts[k]`` records each; their paths."""
    os.makedirs(folder, exist_ok=True)
    paths, first = [], 0
    for k, count in enumerate(counts):
        path = os.path.join(os.fspath(folder), f"part-{k}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(first, first + count):
                writer.write(example(i))
        paths.append(path)
        first += count
    return paths


def parse_id(record):
    """A record's global number."""
    return tf.io.parse_single_example(record, FEATURES)["id"]


def parse_xy(record):
    """``(x, label)`` for a model: x is ``[2 id, 1]``."""
    ex = tf.io.parse_single_example(record, FEATURES)
    return ex["x"], ex["label"]


def corrupt_record(path: str, record: int) -> None:
    """Flips a byte inside record ``record``'s data, so its CRC no longer matches."""
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    offset = 0
    for _ in range(record):
        length = int(np.frombuffer(bytes(blob[offset:offset + 8]), "<u8")[0])
        offset += 12 + length + 4
    blob[offset + 12 + 3] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(blob))


TFDS_NAME = "hvd_balance_tiny"
TFDS_TRAIN, TFDS_TEST = 120, 30


def tfds_builder_class():
    """The tiny builder (registered as ``hvd_balance_tiny`` on first call): ``train`` holds
    ids 0..119, ``test`` 120..149; features ``image`` (4x4x1 uint8, value ``id % 256``),
    ``label`` (``id % 10``) and ``id``."""
    global _BUILDER
    if _BUILDER is not None:
        return _BUILDER
    import tensorflow_datasets as tfds

    class HvdBalanceTiny(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict({
                    "image": tfds.features.Tensor(shape=(4, 4, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                    "id": tfds.features.Scalar(dtype=np.int64)}),
                supervised_keys=("image", "label"))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(0, TFDS_TRAIN),
                    "test": self._generate_examples(TFDS_TRAIN, TFDS_TRAIN + TFDS_TEST)}

        def _generate_examples(self, start, stop):
            for i in range(start, stop):
                yield i, {"image": np.full((4, 4, 1), i % 256, np.uint8), "label": i % 10, "id": i}

    _BUILDER = HvdBalanceTiny
    return _BUILDER


_BUILDER = None


def prepare_tfds(data_dir) -> None:
    """Builds the tiny data set in ``data_dir`` (no download)."""
    tfds_builder_class()(data_dir=os.fspath(data_dir)).download_and_prepare()

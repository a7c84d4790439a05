"""BalancedData's input sources on real ranks: equal steps, exact cover, a clear error on each.

Usage: horovodrun -np 2 python sources_fit.py cover RECORDS_DIR TFDS_DIR
       horovodrun -np 2 python sources_fit.py bad RECORDS_DIR TFDS_DIR
cover: for each source (TFRecord files, tfds, a tf.data.Dataset) ``fit`` runs 2 epochs under
    the plan [5, 11] (global batch 16); every record a rank parses is logged by its parse
    function, per epoch. Emits {"rank", "sources": {name: {"steps": [per epoch],
    "ids": [[ids parsed in epoch e]], "records_read"}}}.
bad: the cases each rank must refuse at construction: a missing file, a corrupt record
    (RECORDS_DIR/corrupt/), a parse function that fails, an empty tfds split. Emits
    {"rank", "errors": {case: "<type>: <message>" or null}}.
midway: hvd_balance.watchdog on; the parse function fails on records 90..99, which only the
    rank(s) given them meet, in the middle of the first epoch; prints FINISHED if fit returns.
"""
import os
import sys

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _result import emit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import record_files as rf  # noqa: E402

hvd.init()
rank = hvd.rank()
mode, records_dir, tfds_dir = sys.argv[1], sys.argv[2], sys.argv[3]
PLAN = hvd_balance.Plan.from_batch_sizes([5, 11])
parsed = []  # ids parsed by this rank's input pipeline since the last epoch end


def note(ids):
    parsed.extend(int(i) for i in np.atleast_1d(ids))
    return ids


def logged(ids):
    out = tf.numpy_function(note, [ids], tf.int64)
    out.set_shape(ids.shape)
    return out


def parse(record):
    ex = tf.io.parse_single_example(record, rf.FEATURES)
    return tf.stack([tf.cast(logged(ex["id"]), tf.float32), 1.0]), ex["label"]


class Recorder(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps, self.ids = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(0)

    def on_train_batch_begin(self, batch, logs=None):
        self.steps[-1] += 1

    def on_epoch_end(self, epoch, logs=None):
        self.ids.append(sorted(parsed))
        parsed.clear()


def train(data):
    parsed.clear()  # the record each source decodes when it is made
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(10)])
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    recorder = Recorder()
    model.fit(data, epochs=2, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd_balance.LoadBalancer(data, plan=PLAN, verbose=0), recorder])
    index = getattr(data, "record_index", None)
    return {"steps": recorder.steps, "ids": recorder.ids,
            "records_read": None if index is None else index.records_read}


def error_of(make):
    try:
        make()
    except Exception as err:  # noqa: BLE001 (reported to the test)
        return f"{type(err).__name__}: {err}"
    return None


files = sorted(os.path.join(records_dir, f) for f in os.listdir(records_dir) if f.endswith(".tfrecord"))
if mode == "cover":
    rf.tfds_builder_class()
    sources = {
        "tfrecords": train(hvd_balance.BalancedData.from_tfrecords(
            files, parse, global_batch_size=16, seed=1)),
        "tfds": train(hvd_balance.BalancedData.from_tfds(
            rf.TFDS_NAME, "train", global_batch_size=16, data_dir=tfds_dir,
            map_fn=lambda ex: (tf.stack([tf.cast(logged(ex["id"]), tf.float32), 1.0]), ex["label"]))),
        "dataset": train(hvd_balance.BalancedData.from_dataset(
            tf.data.Dataset.range(100).shuffle(100, seed=3), global_batch_size=16,
            map_fn=lambda i: (tf.stack([tf.cast(logged(i), tf.float32), 1.0]), i % 10))),
    }
    emit({"rank": rank, "sources": sources})
elif mode == "bad":
    rf.tfds_builder_class()

    def failing_parse(record):
        return tf.io.parse_single_example(record, {"missing": tf.io.FixedLenFeature([], tf.int64)})

    corrupt = os.path.join(records_dir, "corrupt", "bad.tfrecord")
    errors = {
        "missing_file": error_of(lambda: hvd_balance.BalancedData.from_tfrecords(
            files + [os.path.join(records_dir, "absent.tfrecord")], parse, global_batch_size=16)),
        "corrupt_record": error_of(lambda: hvd_balance.BalancedData.from_tfrecords(
            [corrupt], parse, global_batch_size=16)),
        "parse_fails": error_of(lambda: hvd_balance.BalancedData.from_tfrecords(
            files, failing_parse, global_batch_size=16)),
        "empty_split": error_of(lambda: hvd_balance.BalancedData.from_tfds(
            rf.TFDS_NAME, "train[:0]", global_batch_size=16, data_dir=tfds_dir)),
    }
    emit({"rank": rank, "errors": errors})
elif mode == "midway":
    from hvd_balance import watchdog
    watchdog.install()

    def parse_until_90(record):
        ids = tf.io.parse_single_example(record, rf.FEATURES)["id"]
        with tf.control_dependencies([tf.debugging.assert_less(
                ids, tf.constant(90, tf.int64), message="bad record id")]):
            return tf.stack([tf.cast(ids, tf.float32), 1.0]), ids % 10

    train(hvd_balance.BalancedData.from_tfrecords(files, parse_until_90, global_batch_size=16, seed=1))
    print(f"FINISHED {rank}", flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"DONE {rank}", flush=True)

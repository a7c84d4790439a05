"""Elastic training with hvd_balance.elastic while workers leave; every sample trained is logged.

Usage: horovodrun -np 3 --min-np 2 --max-np 3 --network-interface lo \
           --host-discovery-script DISCOVER python elastic_fit.py OUT EPOCHS MARKER_AT [DIE_HOST]
OUT: a directory for the logs and the marker file ``OUT/marker``, which the discovery
    script reads; rank 0 creates it during the step that ends with its commit number
    MARKER_AT (so the discovered hosts change mid-run), holding the world size then; the
    ranks slow down while the world still has that size, so the reset comes mid-run.
    MARKER_AT may be two commit numbers, ``6,14``: at the second, rank 0 makes
    ``OUT/marker2`` the same way (two changes of hosts in one run).
DIE_HOST: instead, the worker on host DIE_HOST (``HOROVOD_HOSTNAME``) SIGKILLs itself two
    steps after its commit number MARKER_AT, in the middle of a segment (a worker lost with
    uncommitted work).
Every worker process appends to ``OUT/worker-<pid>.log``:
    ENTRY <n> <rank> <size>                     each call of the elastic training function
    FIT <n> <epoch> <step> <size> <plan json>   each model.fit inside it (Plan.to_dict())
    TRAINED <n> <epoch> <step> <ids json>       each training step: the ids of the samples
                                                this rank's batch really held (recorded
                                                inside the compiled step)
    DONE <rank> <size> <weights checksum>       when training is over
The model's input carries the sample id in its last column; the first layer records it and
drops it, so the log shows what the pipeline fed, not what the data set says it should.
"""
import json
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from hvd_balance import elastic

hvd.init()
out, epochs = sys.argv[1], int(sys.argv[2])
marker_ats = [int(m) for m in sys.argv[3].split(",")]
marker_at = marker_ats[0]
MARKERS = ["marker", "marker2"][:len(marker_ats)]
die_host = sys.argv[4] if len(sys.argv) > 4 else None
STEP_DELAY_S = 0.05
log_file = open(os.path.join(out, f"worker-{os.getpid()}.log"), "a", buffering=1)

N, B, SEGMENT = 1536, 48, 4  # 32 steps of 48 samples per epoch, a commit every 4 steps
rng = np.random.default_rng(0)
features = rng.normal(size=(N, 10)).astype("float32")
x = np.concatenate([features, np.arange(N, dtype="float32")[:, None]], axis=1)
y = (features[:, 0] > 0).astype("int32")
data = hvd_balance.BalancedData(x, y, global_batch_size=B, seed=5, segment_steps=SEGMENT)

seen_ids = []


def record(ids):
    seen_ids.append(ids.numpy().astype(int).tolist())
    return np.float32(0)


class RecordIds(tf.keras.layers.Layer):
    """Records the id column of a training batch (in the compiled step) and drops it."""

    def call(self, inputs, training=None):
        features = inputs[:, :-1]
        if not training:
            return features
        done = tf.py_function(record, [inputs[:, -1]], tf.float32)
        with tf.control_dependencies([done]):
            return tf.identity(features)


tf.keras.utils.set_random_seed(1)
model = tf.keras.Sequential([tf.keras.Input((11,)), RecordIds(),
                             tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(2)])
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              jit_compile=False)
state = elastic.ElasticState(model, data)
entry = 0


def marker_size():
    """The world size when the latest marker was made (None before the first)."""
    for name in reversed(MARKERS):
        try:
            with open(os.path.join(out, name)) as f:
                return int(f.read())
        except OSError:
            continue
    return None


def marker_due():
    """The marker rank 0 makes at the commit ending this step, or None."""
    for name, at in zip(MARKERS, marker_ats):
        if state.commits + 1 == at and not os.path.exists(os.path.join(out, name)):
            return name
    return None


class Audit(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.offset = state.step
        log_file.write(f"FIT {entry} {state.epoch} {state.step} {hvd.size()} "
                       f"{json.dumps(state.plan.to_dict())}\n")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        seen_ids.clear()
        time.sleep(STEP_DELAY_S)
        if die_host is None and marker_size() == hvd.size():
            time.sleep(0.3)  # the hosts change: slow down until the reset comes

    def on_train_batch_end(self, batch, logs=None):
        (ids,) = seen_ids
        step = self.offset + batch
        log_file.write(f"TRAINED {entry} {self.epoch} {step} {json.dumps(ids)}\n")
        if die_host is not None:
            if (os.environ.get("HOROVOD_HOSTNAME") == die_host and state.commits == marker_at
                    and (step + 1) % SEGMENT == 2):
                log_file.write(f"KILLED {self.epoch} {step}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        elif hvd.rank() == 0 and marker_due():
            name = marker_due()
            with open(os.path.join(out, f"{name}.tmp"), "w") as f:
                f.write(str(hvd.size()))  # the commit at the end of this step is its number
            os.replace(os.path.join(out, f"{name}.tmp"), os.path.join(out, name))

    def on_epoch_end(self, epoch, logs=None):
        self.offset = 0


@hvd.elastic.run
def train(state):
    global entry
    entry += 1
    log_file.write(f"ENTRY {entry} {hvd.rank()} {hvd.size()}\n")
    elastic.fit(state, epochs=epochs, callbacks=[Audit()], repeats=3, plan_verbose=1)


train(state)
checksum = float(sum(float(tf.reduce_sum(v)) for v in model.trainable_variables))
log_file.write(f"DONE {hvd.rank()} {hvd.size()} {checksum!r}\n")
print(f"DONE rank {hvd.rank()} of {hvd.size()}", flush=True)

"""A slow rank stays visible through synchronized batch normalization: to the StepTimer and to
the per-step telemetry.

Usage: horovodrun -np 2 python sync_batch_norm_telemetry.py sync|local DELAY_MS
Both ranks train the same model, Dense -> batch normalization (``sync``:
hvd_balance.SyncBatchNormalization; ``local``: Keras's per-rank layer) -> Dense, on equal
batches; rank 1 also busy-waits ``DELAY_MS`` milliseconds per sample in a layer before the
normalization, so rank 0 waits for it inside the layer's allreduces. First each rank times its
step with the StepTimer at sizes of its own (rank 0: 4 and 8 samples; rank 1: 4, 8 and 16: a
different number of calls, which a collective in the timed step would hang on), then ``fit``
runs ``STEPS`` steps with hvd_balance's DistributedOptimizer. Emits per rank {"rank", "curve"
(the StepTimer's [[batch, seconds], ...]), "telemetry" (the optimizer's telemetry read after
fit), "busy_median_s" (the median busy seconds of the counted steps)}.
"""
import sys

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _busy import PerSampleBusy
from _result import emit
from hvd_balance.keras.step_timer import measure_curve

hvd.init()
rank = hvd.rank()
variant = sys.argv[1]
delay_s = float(sys.argv[2]) / 1e3 if rank == 1 else 0.0
BATCH, STEPS = 16, 24


norm = {"sync": hvd_balance.SyncBatchNormalization,
        "local": tf.keras.layers.BatchNormalization}[variant]
rng = np.random.default_rng(rank)
x = rng.normal(size=(BATCH * STEPS, 10)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
tf.keras.utils.set_random_seed(1)
model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(16), PerSampleBusy(delay_s),
                             norm(), tf.keras.layers.ReLU(), tf.keras.layers.Dense(2)])
opt = hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.05))
model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

sizes = [4, 8] if rank == 0 else [4, 8, 16]
curve, _ = measure_curve(model, (x[:BATCH], y[:BATCH]), sizes)

data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
model.fit(data, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
telemetry = opt.telemetry.read()
emit({"rank": rank, "curve": [[int(b), float(t)] for b, t in curve], "telemetry": telemetry,
      "busy_median_s": float(np.median(telemetry["busy_samples"]))})

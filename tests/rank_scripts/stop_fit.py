"""Rank 1 alone asks to stop; where the asking callback sits, and when it asks, decides how.

Usage: horovodrun -np 2 python stop_fit.py {before,after}
  before: the stopping callback comes before hvd_balance's: every rank stops after epoch 3.
  after:  it comes after them: every rank raises StopMismatchError naming rank 1, at once.
Emits per rank: {"rank", "epochs_run", "error"}.

Usage: horovodrun -np 2 python stop_fit.py mid {callbacks,balancer,watchdog} {callback,nan}
  rank 1 stops in the middle of epoch 0, after batch 5 (of 20): its own callback sets
  stop_training (callback), or its loss turns NaN there and TerminateOnNaN stops it (nan);
  with hvd_balance's broadcast and metric callbacks, LoadBalancer alone, or the watchdog
  alone. Every rank's fit returns; then each rank (alive) emits {"rank", "epochs_run",
  "batches_run", "error", "stop" (stop_agreement.last_mid_epoch_stop), "stopped_at" (rank 1:
  when it stopped), "fit_returned_at" (time.time())}.
"""
import sys

import numpy as np
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from _result import emit

hvd.init()
where = sys.argv[1]
if where == "mid":
    import mid_epoch_stop  # noqa: F401 - runs the mid-epoch case and exits


class StopOnRankOne(tf.keras.callbacks.Callback):
    """What EarlyStopping on rank 1's own loss does: set stop_training after epoch 3 there."""

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 1 and epoch == 2:
            self.model.stop_training = True


class Count(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.epochs = 0

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


rng = np.random.default_rng(0)
x, y = rng.normal(size=(256, 4)).astype("float32"), rng.integers(0, 2, 256)
data = hvd_balance.BalancedData(x, y, global_batch_size=32, seed=0)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
ours = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd_balance.LoadBalancer(data, plan=hvd_balance.Plan.from_batch_sizes([20, 12]), verbose=0),
        hvd.callbacks.MetricAverageCallback()]
count, stop = Count(), StopOnRankOne()
callbacks = [count, stop, *ours] if where == "before" else [count, *ours, stop]
error = None
try:
    model.fit(data, epochs=8, verbose=0, callbacks=callbacks)
except Exception as err:  # noqa: BLE001 - reported to the test
    error = f"{type(err).__name__}: {err}"
emit({"rank": hvd.rank(), "epochs_run": count.epochs, "error": error})

"""A small balanced training run that reports what every rank did, for the tests to audit.

Usage: horovodrun -np N python balanced_fit.py MODE
MODE "audit": benchmark, plan and train 3 epochs with validation; emit per rank
    (``_result.emit``) {"rank", "plan", "steps", "indices", "val_loss", "val_sum", "val_count", ...}.
MODE "save PATH": as audit, writing the plan to PATH; "load PATH": as audit, using PATH.
MODE one of the bad inputs below: print "ERROR <type>: <message>" and exit 3.
"""
import sys

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _result import emit

hvd.init()
mode = sys.argv[1]
rank, size = hvd.rank(), hvd.size()
rng = np.random.default_rng(0)
x = rng.normal(size=(700, 10)).astype("float32")
y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
global_batch, seed, cap, plan, save = 64, 0, None, None, None
rebalance, aggregate = "off", {}
if mode == "global_batch_mismatch":
    global_batch = 64 if rank == 0 else 48
elif mode == "seed_mismatch":
    seed = rank
elif mode == "caps_too_small":
    cap = 20
elif mode == "plan_world_size":
    plan = hvd_balance.Plan.from_batch_sizes([30, 20, 14][: size + 1] if size < 3 else [60, 4])
elif mode == "save":
    save = sys.argv[2]
elif mode == "load":
    plan = sys.argv[2]
elif mode == "plan_global_batch":
    plan = hvd_balance.Plan.from_batch_sizes([40] * size)
elif mode == "aggregation_across_plans":
    rebalance, aggregate = "epoch", {"backward_passes_per_step": 2}


class StepCounter(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1


try:
    data = hvd_balance.BalancedData(x[:600], y[:600], global_batch_size=global_batch, seed=seed)
    val = hvd_balance.BalancedData(x[600:], y[600:], global_batch_size=50, shuffle=False)
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **aggregate),
                  loss=loss, metrics=["accuracy"])
    balancer = hvd_balance.LoadBalancer(data, plan=plan, validation_data=val, max_batch_size=cap,
                                        save_plan=save, rebalance=rebalance, verbose=0)
    counter = StepCounter()
    history = model.fit(data, validation_data=val, epochs=3, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer,
        hvd_balance.WeightedMetricAverage(data, val), counter])
except (ValueError, TypeError, RuntimeError) as err:
    print(f"ERROR {type(err).__name__}: {err}", flush=True)
    sys.exit(3)

# What this rank's validation shard gives with the final weights, per sample.
val_index = np.concatenate(val.indices(0))
per_sample = tf.keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction="none")(y[600:][val_index], model(x[600:][val_index])).numpy()
# What the pipeline really yields for epoch 1 equals data.indices(1).
data.set_epoch(1)
pipeline = np.concatenate([b[0].numpy() for b in data])
expected = x[:600][np.concatenate(data.indices(1))]
emit({
    "rank": rank, "plan": balancer.plan.to_dict(), "steps": counter.steps, "len": len(data),
    "indices": [np.concatenate(data.indices(e)).tolist() for e in range(3)],
    "pipeline_matches_indices": bool(np.array_equal(pipeline, expected)),
    "local_batch": data.local_batch_size, "val_local_batch": val.local_batch_size,
    "val_loss": history.history["val_loss"][-1], "loss": history.history["loss"],
    "val_sum": float(per_sample.sum()), "val_count": int(per_sample.size),
})

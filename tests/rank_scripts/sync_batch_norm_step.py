"""Balanced steps through batch normalization equal one process with Keras's layer on the global batch.

Usage: horovodrun -np N python sync_batch_norm_step.py 1,6,13 sync,local,horovod,unweighted
Variants: ``sync``: hvd_balance.SyncBatchNormalization; ``local``: Keras's BatchNormalization
on each rank's own batch; ``horovod``: Horovod's SyncBatchNormalization (the ranks' statistics
averaged unweighted); ``unweighted``: hvd_balance's layer with the count-weighted forward pass
but Horovod's own gradient of the allreduce (the unweighted sum of the ranks' gradients).
Emits per rank, for each variant v and model m (dense, conv): ``err_trainable_<v>_<m>`` and
``err_moving_<v>_<m>`` (max relative error against one process with Keras's layer on the
global batch), ``moving_<v>_<m>`` (the moving statistics, flattened, to compare across ranks),
``moved_<v>_<m>`` and ``error_<v>_<m>`` (an exception's text when the layer does not run, e.g.
Horovod's on Keras 3; else None).
"""
import sys

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import horovod.tensorflow as horovod_tf
import hvd_balance
from _result import emit
from hvd_balance.keras import sync_batch_norm

weighted_global_sum = sync_batch_norm._global_sum

hvd.init()
batches = [int(b) for b in sys.argv[1].split(",")]
variants = sys.argv[2].split(",")
assert len(batches) == hvd.size(), (batches, hvd.size())
plan = hvd_balance.Plan.from_batch_sizes(batches)
B = plan.global_batch_size
steps = 2
rng = np.random.default_rng(0)
n = steps * B


def layer_class(variant):
    # "unweighted": Horovod's registered gradient of its allreduce instead of the weighted one
    sync_batch_norm._global_sum = (
        (lambda local, samples, name: horovod_tf.allreduce(local, op=horovod_tf.Sum, name=name))
        if variant == "unweighted" else weighted_global_sum)
    if variant in ("sync", "unweighted"):
        return hvd_balance.SyncBatchNormalization
    if variant == "horovod":
        return horovod_tf.SyncBatchNormalization
    return tf.keras.layers.BatchNormalization


def dense_model(bn):
    return tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(8, use_bias=False), bn(momentum=0.5),
                                tf.keras.layers.Activation("tanh"), tf.keras.layers.Dense(5)])


def conv_model(bn):
    return tf.keras.Sequential([tf.keras.Input((6, 6, 2)), tf.keras.layers.Conv2D(4, 3, use_bias=False), bn(momentum=0.5),
                                tf.keras.layers.Activation("tanh"), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(5)])


cases = {"dense": (dense_model, rng.normal(1.0, 2.0, size=(n, 6)).astype("float32")),
         "conv": (conv_model, rng.normal(1.0, 2.0, size=(n, 6, 6, 2)).astype("float32"))}
y = rng.integers(0, 5, size=n)
loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
result = {"rank": hvd.rank(), "batches": batches}


def rel_err(got, want):
    return max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(got, want))


for variant, (name, (make, x)) in ((v, case) for v in variants for case in cases.items()):
    key = f"{variant}_{name}"
    tf.keras.utils.set_random_seed(7)
    try:
        model = make(layer_class(variant))
        data = hvd_balance.BalancedData(x, y, global_batch_size=B, seed=3)
        model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)), loss=loss)
    except Exception as e:  # Horovod's layer on Keras 3
        result[f"error_{key}"] = f"{type(e).__name__}: {e}"[:500]
        continue
    ref = make(tf.keras.layers.BatchNormalization)
    ref.set_weights(model.get_weights())
    start = [w.copy() for w in model.get_weights()]
    try:
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0,
                  callbacks=[hvd_balance.LoadBalancer(data, plan=plan, verbose=0)])
    except Exception as e:
        result[f"error_{key}"] = f"{type(e).__name__}: {e}"[:500]
        continue
    # The single process: the same start, the same steps on the union of the ranks' batches.
    ref.compile(optimizer=tf.keras.optimizers.SGD(0.5), loss=loss)
    for step in range(steps):
        global_batch = np.concatenate([data.indices(0, rank=r)[step] for r in range(hvd.size())])
        ref.train_on_batch(x[global_batch], y[global_batch])
    is_trainable = [any(v is t for t in model.trainable_weights) for v in model.weights]
    got, want = model.get_weights(), ref.get_weights()
    result[f"err_trainable_{key}"] = rel_err([g for g, t in zip(got, is_trainable) if t],
                                              [w for w, t in zip(want, is_trainable) if t])
    moving_got = [g for g, t in zip(got, is_trainable) if not t]
    result[f"err_moving_{key}"] = rel_err(moving_got, [w for w, t in zip(want, is_trainable) if not t])
    result[f"moving_{key}"] = np.concatenate([m.ravel() for m in moving_got]).tolist()
    result[f"moved_{key}"] = max(float(np.max(np.abs(a - b))) for a, b in zip(got, start))
    result[f"error_{key}"] = None
emit(result)

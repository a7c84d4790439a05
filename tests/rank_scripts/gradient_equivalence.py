"""One SGD step with unequal local batches equals a single process on the global batch.

Usage: horovodrun -np N python gradient_equivalence.py 5,17,42
Emits per rank (``_result.emit``): {"rank", "max_rel_err_dense", "max_rel_err_sparse", "batches"}
(``executed``: two steps in one execution, ``steps_per_execution=2``; ``accumulated``, Keras 3
only: two steps with ``gradient_accumulation_steps=2``; ``fp16``: the dense step with the
gradients allreduced as float16, ``hvd.Compression.fp16``).
"""
import sys

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _result import emit
from hvd_balance.keras.compat import KERAS3

hvd.init()
batches = [int(b) for b in sys.argv[1].split(",")]
assert len(batches) == hvd.size(), (batches, hvd.size())
plan = hvd_balance.Plan.from_batch_sizes(batches)
B = plan.global_batch_size
rng = np.random.default_rng(0)
n = 3 * B


def dense_model():
    return tf.keras.Sequential([tf.keras.Input((6, 6, 2)), tf.keras.layers.Conv2D(4, 3, activation="tanh"),
                                tf.keras.layers.Flatten(), tf.keras.layers.Dense(5)])


def sparse_model():  # an Embedding gives tf.IndexedSlices gradients
    return tf.keras.Sequential([tf.keras.Input((4,), dtype="int32"), tf.keras.layers.Embedding(50, 3),
                                tf.keras.layers.Flatten(), tf.keras.layers.Dense(5)])


cases = {
    "dense": (dense_model, rng.normal(size=(n, 6, 6, 2)).astype("float32")),
    "sparse": (sparse_model, rng.integers(0, 50, size=(n, 4)).astype("int32")),
}
y = rng.integers(0, 5, size=n)
loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
result = {"rank": hvd.rank(), "batches": batches}
# Keras 3 accumulates gradients itself (gradient_accumulation_steps): every step is reduced
# and accumulated, so two accumulated steps equal one process doing the same on global batches.
# (name, model, inputs, optimizer options, steps, compile options)
runs = [(name, make, x, {}, 1, {}) for name, (make, x) in cases.items()]
# Two steps in one execution of the compiled loop.
runs.append(("executed", dense_model, cases["dense"][1], {}, 2, {"steps_per_execution": 2}))
# The weighted gradients allreduced in half precision: the same step to fp16's precision.
runs.append(("fp16", dense_model, cases["dense"][1], {}, 1, {}))
if KERAS3:
    runs.append(("accumulated", dense_model, cases["dense"][1], {"gradient_accumulation_steps": 2}, 2, {}))
for name, make, x, extra, steps, compile_options in runs:
    tf.keras.utils.set_random_seed(7)
    model = make()
    start = [w.copy() for w in model.get_weights()]
    data = hvd_balance.BalancedData(x, y, global_batch_size=B, seed=3)
    compression = hvd.Compression.fp16 if name == "fp16" else hvd.Compression.none
    opt = hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.5, **extra),
                                           compression=compression)
    model.compile(optimizer=opt, loss=loss, **compile_options)
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[hvd_balance.LoadBalancer(data, plan=plan, verbose=0)])
    # The single-process reference: the same start, the same steps on the union of the
    # ranks' batches.
    ref = make()
    ref.set_weights(start)
    ref.compile(optimizer=tf.keras.optimizers.SGD(0.5, **extra), loss=loss)
    for step in range(steps):
        global_batch = np.concatenate([data.indices(0, rank=r)[step] for r in range(hvd.size())])
        ref.train_on_batch(x[global_batch], y[global_batch])
    err = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
              for a, b in zip(model.get_weights(), ref.get_weights()))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), start))
    result[f"max_rel_err_{name}"] = err
    result[f"moved_{name}"] = moved
    result[f"weight_{name}"] = opt.gradient_weight.get()
emit(result)

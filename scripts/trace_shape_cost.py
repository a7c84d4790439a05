"""Whether Keras 3's train function is slower per step once ``tf.function`` has relaxed the batch
dimension (the default's first steps run other batch sizes before the plan's).

Usage: python scripts/trace_shape_cost.py specialized|relaxed BATCH

One process, the bench's CNN (``--model cnn``), SGD with momentum 0.9. ``specialized``: the
train function sees only BATCH samples; ``relaxed``: it first runs 256 and 424 samples (two
steps each), so later calls use a trace whose batch dimension is unknown. Prints one JSON line:
the median of 60 timed ``train_on_batch`` calls at BATCH after 5 untimed ones, in ms. Run it
with the bench ranks' thread settings (``TF_NUM_INTRAOP_THREADS=1`` etc., BENCHMARKS.md).
"""
import json
import sys
import time

import numpy as np
import tensorflow as tf

from hvd_balance.tools.bench.worker import _model_parts


def main() -> None:
    variant, batch = sys.argv[1], int(sys.argv[2])
    if variant not in ("specialized", "relaxed"):
        raise SystemExit(f"trace_shape_cost: variant must be specialized or relaxed; got {variant!r}")
    tf.keras.utils.set_random_seed(0)
    shape, layers = _model_parts("cnn")
    model = tf.keras.Sequential([tf.keras.Input(shape), *layers])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)

    def xy(b):
        return rng.normal(size=(b, *shape)).astype("float32"), rng.integers(0, 10, size=b)

    if variant == "relaxed":
        for b in (256, 424):
            x, y = xy(b)
            model.train_on_batch(x, y)
            model.train_on_batch(x, y)
    x, y = xy(batch)
    for _ in range(5):
        model.train_on_batch(x, y)
    times = []
    for _ in range(60):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    print(json.dumps({"variant": variant, "batch": batch, "median_ms": 1e3 * float(np.median(times))}))


if __name__ == "__main__":
    main()

"""Telemetry's cost: the same single-process fit with hvd_balance's step telemetry on and off.

    python scripts/telemetry_cost.py --reps 5

Interleaves the two variants (on, off, on, off, ...) and prints the median seconds per step
of each over epochs 2.. and their ratio.
"""
import argparse
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance


def epoch_seconds(telemetry: bool, x, y, epochs: int) -> list:
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((16, 16, 1)), tf.keras.layers.Conv2D(32, 3, activation="relu"),
                                 tf.keras.layers.Conv2D(32, 3, activation="relu"), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), telemetry=telemetry),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times = []

    class Clock(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, shuffle=False, callbacks=[Clock()])
    return times[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=6400)
    args = parser.parse_args()
    hvd.init()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 16, 16, 1)).astype("float32")
    y = rng.integers(0, 10, size=args.samples)
    steps = args.samples // 64
    on, off = [], []
    for _ in range(args.reps):
        on += epoch_seconds(True, x, y, args.epochs)
        off += epoch_seconds(False, x, y, args.epochs)
    t_on, t_off = np.median(on) / steps, np.median(off) / steps
    print(f"telemetry on: {1e3 * t_on:.3f} ms/step, off: {1e3 * t_off:.3f} ms/step, "
          f"cost {100 * (t_on / t_off - 1):+.2f} % ({len(on)} epochs each)")


if __name__ == "__main__":
    main()

"""What hvd_balance adds to a step: the same single-process fit with plain Horovod's optimizer
and with hvd_balance's (weighted, with and without its step telemetry).

    python scripts/telemetry_cost.py --reps 5                       # weighted+telemetry vs plain
    python scripts/telemetry_cost.py --variants telemetry,weighted  # telemetry on vs off
    python scripts/telemetry_cost.py --variants telemetry,watched   # + the watchdog's StopWatch

Variants: ``plain`` is Horovod's unweighted average (on Keras 3, where Horovod's own never
reduces, the same optimizer subclass with a plain ``grouped_allreduce(op=Average)``);
``weighted`` is ``hvd_balance.DistributedOptimizer(telemetry=False)``; ``telemetry`` is
``hvd_balance.DistributedOptimizer()`` as users get it; ``watched`` is ``telemetry`` with the
stop agreement's board open and the :class:`~hvd_balance.keras.stop_agreement.StopWatch`
callback that ``watchdog.install()`` adds to every fit. They run interleaved (A B A B ...), and
the script prints the median seconds per step of each over epochs 2.. and each one's cost
against the first variant.
"""
import argparse
import time

import numpy as np
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd
from hvd_balance.keras import compat

OPTIMIZERS = {
    "plain": lambda sgd: compat.horovod_optimizer(sgd),
    "weighted": lambda sgd: hvd_balance.DistributedOptimizer(sgd, telemetry=False),
    "telemetry": lambda sgd: hvd_balance.DistributedOptimizer(sgd),
    "watched": lambda sgd: hvd_balance.DistributedOptimizer(sgd),
}


def epoch_seconds(variant: str, x, y, epochs: int) -> list:
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((16, 16, 1)), tf.keras.layers.Conv2D(32, 3, activation="relu"),
                                 tf.keras.layers.Conv2D(32, 3, activation="relu"), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer=OPTIMIZERS[variant](tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times = []

    class Clock(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    extra = []
    if variant == "watched":
        from hvd_balance.keras import stop_agreement, stop_notice
        stop_notice.open_board()
        extra = [stop_agreement.StopWatch()]
    model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, shuffle=False, callbacks=[Clock(), *extra])
    return times[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=6400)
    parser.add_argument("--variants", default="plain,telemetry",
                        help=f"comma-separated, from {sorted(OPTIMIZERS)}; the first is the baseline")
    args = parser.parse_args()
    variants = args.variants.split(",")
    hvd.init()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 16, 16, 1)).astype("float32")
    y = rng.integers(0, 10, size=args.samples)
    steps = args.samples // 64
    seconds = {v: [] for v in variants}
    for _ in range(args.reps):
        for v in variants:
            seconds[v] += epoch_seconds(v, x, y, args.epochs)
    per_step = {v: float(np.median(s)) / steps for v, s in seconds.items()}
    base = variants[0]
    print(f"Keras {compat.KERAS_VERSION}, TensorFlow {tf.__version__}, "
          f"{len(seconds[base])} epochs of {steps} steps each:")
    for v in variants:
        print(f"  {v:9s} {1e3 * per_step[v]:.3f} ms/step, {100 * (per_step[v] / per_step[base] - 1):+.2f} % "
              f"against {base}")


if __name__ == "__main__":
    main()

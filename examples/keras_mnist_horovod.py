"""Horovod's Keras MNIST example, balanced with hvd_balance; Keras 3, tf-keras or Keras 2.

    horovodrun -np 2 python examples/keras_mnist_horovod.py
    python examples/keras_mnist_horovod.py                  # one process: the same script

This is the shape of Horovod's ``examples/tensorflow2/tensorflow2_keras_mnist.py``; the lines
marked ``# hvd_balance:`` are what balancing changes. With ``--no-balance`` it is Horovod's
example as written (equal batches from a repeated, shuffled ``tf.data`` pipeline), but for
the import line, the device pinning and checkpoints saved as ``.keras`` (Keras 3's format).
The data is scikit-learn's digits padded to MNIST's 28x28, so nothing is downloaded;
``--samples`` repeats them to a larger epoch. Rank 0 prints the plan (the local batch of each
rank), each epoch's loss and accuracy, and whether every rank ended with the same weights;
``--json FILE`` also writes them. Checkpoints go to ``--checkpoint-dir``.
"""
import argparse
import hashlib
import json
import os

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvd_balance
import hvd_balance.keras as hvd  # hvd_balance: was `import horovod.tensorflow.keras as hvd`


def load_data(samples):
    """scikit-learn's 1797 digits as 28x28x1 float32 images in [0, 1] and int64 labels,
    repeated (or cut) to ``samples`` samples."""
    digits = load_digits()
    images = np.kron(digits.images / 16.0, np.ones((3, 3)))                 # 8x8 -> 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None].astype("float32")  # 28x28x1
    take = np.arange(samples) % len(images)
    return images[take], digits.target.astype("int64")[take]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=128,
                        help="samples per rank per step on average: the global batch is this x ranks")
    parser.add_argument("--samples", type=int, default=1797, help="training samples per epoch")
    parser.add_argument("--warmup-epochs", type=int, default=3)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--json", help="rank 0 writes the plan, history and weight check here")
    parser.add_argument("--no-balance", action="store_true",
                        help="Horovod's example as written: equal batches, no LoadBalancer")
    args = parser.parse_args()

    # Horovod: initialize Horovod.
    hvd.init()
    # hvd_balance: one device per local rank (a GPU each while there are GPUs, then the CPU);
    # replaces Horovod's pinning of GPU local_rank, so a node may run more ranks than GPUs.
    hvd_balance.pin_devices()

    images, labels = load_data(args.samples)
    global_batch = args.batch_size * hvd.size()
    steps_per_epoch = max(1, args.samples // global_batch)
    if args.no_balance:
        dataset = tf.data.Dataset.from_tensor_slices((images, labels))
        dataset = dataset.repeat().shuffle(10000).batch(args.batch_size)
    else:
        # hvd_balance: each rank gets its share of the global batch, sized to its speed, and
        # its own part of the data; every rank runs the same steps per epoch.
        dataset = hvd_balance.BalancedData(images, labels, global_batch_size=global_batch, seed=0)

    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
        tf.keras.layers.Conv2D(64, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])

    # Horovod: adjust learning rate based on number of workers (the global batch grows with it).
    scaled_lr = 0.001 * hvd.size()
    # Horovod: add Horovod DistributedOptimizer (hvd_balance's weights each rank's gradient
    # by its share of the global batch; with equal batches it is Horovod's average).
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(scaled_lr),
                                   backward_passes_per_step=1, average_aggregated_gradients=True)
    # Keras 3 has no `experimental_run_tf_function=False`, and none is needed.
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    ]
    if args.no_balance:
        # Horovod: average metrics among workers at the end of every epoch (place it before
        # any callback that reads them).
        callbacks.append(hvd.callbacks.MetricAverageCallback())
    else:
        # hvd_balance: times the first steps, then sets every rank's local batch and weight.
        balancer = hvd_balance.LoadBalancer(dataset)
        # hvd_balance: metrics averaged over all samples (ranks weighted by what they saw).
        callbacks += [balancer, hvd_balance.WeightedMetricAverage(dataset)]
    # Horovod: scale the learning rate up to lr * size over the first epochs.
    callbacks.append(hvd.callbacks.LearningRateWarmupCallback(
        initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1))
    # Horovod: save checkpoints only on worker 0 (Keras 3 saves whole models as .keras).
    if hvd.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0
    history = model.fit(dataset, steps_per_epoch=steps_per_epoch if args.no_balance else None,
                        callbacks=callbacks, epochs=args.epochs, verbose=verbose)

    # Worth keeping while you convert a script: every rank must end with the same weights.
    weights = b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())
    digest = np.frombuffer(hashlib.sha256(weights).digest()[:8], np.int64)
    same_weights = len(set(hvd.allgather(digest, name="weights_digest").tolist())) == 1
    if hvd.rank() == 0:
        batches = ([args.batch_size] * hvd.size() if args.no_balance
                   else [int(b) for b in balancer.plan.batch_sizes])
        h = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        print(f"local batches {batches} (global batch {global_batch}), final loss "
              f"{h['loss'][-1]:.4f}, accuracy {h['accuracy'][-1]:.4f}, "
              f"every rank ends with the same weights: {same_weights}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": hvd.size(), "global_batch": global_batch,
                           "local_batches": batches, "history": h, "same_weights": same_weights,
                           "checkpoints": sorted(os.listdir(args.checkpoint_dir))}, f, indent=1)


if __name__ == "__main__":
    main()

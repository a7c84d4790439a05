"""Horovod's Keras example shape on Keras 3's torch backend, balanced, launched by torchrun.

    KERAS_BACKEND=torch torchrun --standalone --nproc-per-node 2 examples/keras_torch.py
    KERAS_BACKEND=torch python examples/keras_torch.py        # one process: the same script

No TensorFlow and no Horovod: ``import hvd_balance.keras as hvd`` binds the torch backend's
names (torch.distributed, Gloo). The lines marked ``# hvd_balance:`` are what balancing
changes in a Horovod Keras script. The data is scikit-learn's digits (8x8 images), so nothing
is downloaded; ``--samples`` repeats them to a larger epoch. Rank 0 prints the plan, each
epoch's loss and accuracy (averaged over all samples of the epoch) and whether every rank
ended with the same weights; ``--json FILE`` also writes them.
"""
import argparse
import hashlib
import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before Keras is imported

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import hvd_balance.keras as hvd  # noqa: E402 - hvd_balance: was `horovod.tensorflow.keras`


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per rank per step on average: the global batch is this x ranks")
    parser.add_argument("--samples", type=int, default=1797, help="training samples per epoch")
    parser.add_argument("--json", help="rank 0 writes the plan, history and weight check here")
    args = parser.parse_args()

    hvd.init()  # the torch.distributed group torchrun describes
    digits = load_digits()
    take = np.arange(args.samples) % len(digits.images)
    images = (digits.images[take] / 16.0)[..., None].astype("float32")
    labels = digits.target[take].astype("int64")
    global_batch = args.batch_size * hvd.size()
    # hvd_balance: each rank gets its share of the global batch, sized to its speed.
    data = hvd.BalancedData(images, labels, global_batch_size=global_batch, seed=0)

    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
        hvd.SyncBatchNormalization(),  # hvd_balance: statistics over the global batch
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    # Horovod: scale the learning rate by the workers; the optimizer weights each rank's loss by
    # its share of the global batch and sums the gradients.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt, metrics=["accuracy"])
    balancer = hvd.LoadBalancer(data)  # hvd_balance: times the first steps, then plans
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer,
                 hvd.WeightedMetricAverage(data)]  # hvd_balance: metrics over all samples
    history = model.fit(data, epochs=args.epochs, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)

    # Worth keeping while you convert a script: every rank must end with the same weights.
    weights = b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())
    digest = np.frombuffer(hashlib.sha256(weights).digest()[:8], np.int64)
    same_weights = len(set(hvd.allgather(digest).tolist())) == 1
    if hvd.rank() == 0:
        batches = [int(b) for b in balancer.plan.batch_sizes]
        h = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        print(f"local batches {batches} (global batch {global_batch}), final loss "
              f"{h['loss'][-1]:.4f}, accuracy {h['accuracy'][-1]:.4f}, "
              f"every rank ends with the same weights: {same_weights}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": hvd.size(), "global_batch": global_batch,
                           "local_batches": batches, "history": h, "same_weights": same_weights},
                          f, indent=1)
    hvd.end_job()  # barrier, group down, exit: torch 2.13's Gloo can abort a plain exit


if __name__ == "__main__":
    main()

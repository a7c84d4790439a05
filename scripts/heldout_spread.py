"""How much the sample order alone moves the bench ResNet-8's held-out accuracy.

Usage: python scripts/heldout_spread.py --plans "512;256,256;426,86" --seeds 0,1,2,3,4 --epochs 8

One process trains the bench's ResNet-8 (``--model resnet``; Keras's BatchNormalization,
SGD 0.05 with momentum 0.9, the same start weights) on the global batches that the ranks of
each plan would form: step ``s`` takes rank ``i``'s ``s``-th batch of ``BalancedData`` under
that plan, for every ``i``, concatenated. Balanced training with
``hvd_balance.SyncBatchNormalization`` takes exactly this step (statistics, moving statistics
and gradient over the global batch; tests/multirank/test_sync_batch_norm_exact.py), so what
differs between plans here is only which samples share a step. Prints the held-out accuracy
(2,048 samples) after every epoch, per shuffle seed and plan (local batches in samples; "512"
is one process's own order).
"""
import argparse

import numpy as np
import tensorflow as tf

import hvd_balance
from hvd_balance.tools.bench import models, settings

GLOBAL_BATCH = 512  # samples per step, as in the bench runs of BENCHMARKS.md
SAMPLES = 10240  # the --samples of those runs


def global_batches(data, plan, epoch):
    """Per step, the sample indices of all ranks of ``plan`` together."""
    per_rank = [data.indices(epoch, rank=r, plan=plan) for r in range(len(plan.batch_sizes))]
    return [np.concatenate(step) for step in zip(*per_rank)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", default="512;256,256;426,86", help="';'-separated local batches")
    p.add_argument("--seeds", default="0,1,2,3,4", help="BalancedData shuffle seeds")
    p.add_argument("--epochs", type=int, default=8)
    args = p.parse_args()
    x, y, xh, yh = models.make_images(SAMPLES, settings.HELDOUT, 0)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for sizes in args.plans.split(";"):
            plan = hvd_balance.Plan.from_batch_sizes([int(b) for b in sizes.split(",")])
            tf.keras.utils.set_random_seed(0)  # the same start weights for every run
            model = tf.keras.Sequential([tf.keras.Input(models.IMAGE_SHAPE),
                                         *models.resnet_layers("local")])
            model.compile(optimizer=tf.keras.optimizers.SGD(settings.LEARNING_RATE["resnet"], momentum=0.9),
                          loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            data = hvd_balance.BalancedData(x, y, global_batch_size=GLOBAL_BATCH, seed=seed,
                                            rank=0, world_size=len(plan.batch_sizes))
            accuracy = []
            for epoch in range(args.epochs):
                for index in global_batches(data, plan, epoch):
                    model.train_on_batch(x[index], y[index])
                predicted = np.argmax(model.predict(xh, batch_size=GLOBAL_BATCH, verbose=0), -1)
                accuracy.append(float(np.mean(predicted == yh)))
            print(f"seed {seed} plan {sizes}: held-out accuracy by epoch "
                  + " ".join(f"{a:.3f}" for a in accuracy), flush=True)


if __name__ == "__main__":
    main()

"""A small ResNet with synchronized batch normalization, trained from TFRecord files, balanced.

    horovodrun -np 2 python examples/resnet_syncbn_tfrecord.py --make-data /tmp/records
    horovodrun -np 2 python examples/resnet_syncbn_tfrecord.py --data /tmp/records

``--make-data DIR`` first writes small TFRecord files of synthetic 32x32 colour images in 10
classes (``train-*.tfrecord``, ``val-*.tfrecord``; records holding a PNG and a label, as
ImageNet-style converters write them), then trains on them; ``--data DIR`` reads files
already there. Each rank reads and decodes only its own records
(``BalancedData.from_tfrecords``), sized to its speed by ``LoadBalancer``;
``SyncBatchNormalization`` normalizes over the global batch, so a slow rank's small local
batch does not make its statistics noisy, and the moving statistics are the same on every
rank. Rank 0 prints the plan, each epoch's metrics and a final line; ``--json FILE`` also
writes them.
"""
import argparse
import hashlib
import json
import os

import numpy as np
import tensorflow as tf

import hvd_balance
import hvd_balance.keras as hvd

FEATURES = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}


def make_data(folder, train_records, val_records, size, files=4, seed=0):
    """Writes ``files`` training files and one validation file of synthetic images: class
    ``c`` is a fixed random 4x4 colour pattern scaled up to ``size`` x ``size``, plus noise."""
    rng = np.random.default_rng(seed)
    patterns = rng.uniform(0, 255, (10, 4, 4, 3))
    os.makedirs(folder, exist_ok=True)
    parts = [(f"train-{k:05d}-of-{files:05d}.tfrecord", train_records // files) for k in range(files)]
    for name, count in parts + [("val-00000-of-00001.tfrecord", val_records)]:
        path = os.path.join(folder, name)
        with tf.io.TFRecordWriter(path + ".tmp") as writer:
            for label in rng.integers(0, 10, count):
                image = np.kron(patterns[label], np.ones((size // 4, size // 4, 1)))
                image = np.clip(image + rng.normal(0, 60, image.shape), 0, 255).astype("uint8")
                feature = {
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[tf.io.encode_png(image).numpy()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature=feature)).SerializeToString())
        os.replace(path + ".tmp", path)  # whole files only: another rank may read them next


def parse_fn(size):
    """One serialized record -> (float32 image in [0, 1], label)."""
    def parse(record):
        example = tf.io.parse_single_example(record, FEATURES)
        image = tf.io.decode_png(example["image"], channels=3)
        image = tf.ensure_shape(image, (size, size, 3))
        return tf.image.convert_image_dtype(image, tf.float32), example["label"]
    return parse


def batch_norm():
    # Momentum 0.9 (the ResNet paper's, PyTorch's default): Keras's 0.99 needs hundreds of
    # steps before the moving statistics that validation uses are right.
    return hvd_balance.SyncBatchNormalization(momentum=0.9)


def residual_block(x, filters, stride):
    L = tf.keras.layers
    y = L.Conv2D(filters, 3, stride, padding="same", use_bias=False)(x)
    y = L.ReLU()(batch_norm()(y))
    y = L.Conv2D(filters, 3, padding="same", use_bias=False)(y)
    y = batch_norm()(y)
    if stride != 1 or x.shape[-1] != filters:
        x = batch_norm()(L.Conv2D(filters, 1, stride, use_bias=False)(x))
    return L.ReLU()(L.Add()([x, y]))


def resnet(size, classes=10, widths=(16, 32, 64)):
    """A ResNet-8 for small images: a stem, one residual block per width, then pooling."""
    L = tf.keras.layers
    inputs = tf.keras.Input((size, size, 3))
    x = L.Conv2D(widths[0], 3, padding="same", use_bias=False)(inputs)
    x = L.ReLU()(batch_norm()(x))
    for i, width in enumerate(widths):
        x = residual_block(x, width, stride=1 if i == 0 else 2)
    x = L.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, L.Dense(classes)(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="records", help="folder of train-*/val-*.tfrecord")
    parser.add_argument("--make-data", metavar="DIR", help="write synthetic files to DIR first")
    parser.add_argument("--train-records", type=int, default=4096)
    parser.add_argument("--val-records", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=128, help="samples per step over all ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--json", help="rank 0 writes the plan and history here")
    args = parser.parse_args()

    hvd.init()
    hvd_balance.pin_devices()
    if args.make_data:
        args.data = args.make_data
        if hvd.local_rank() == 0:  # once per host (the same bytes if the folder is shared)
            make_data(args.data, args.train_records, args.val_records, args.image_size)
        hvd.allreduce(0, name="data_written")  # no rank reads before the files are there

    parse = parse_fn(args.image_size)
    data = hvd_balance.BalancedData.from_tfrecords(
        os.path.join(args.data, "train-*.tfrecord"), parse, global_batch_size=args.global_batch,
        seed=0)
    val = hvd_balance.BalancedData.from_tfrecords(
        os.path.join(args.data, "val-*.tfrecord"), parse, global_batch_size=args.global_batch,
        shuffle=False)

    model = resnet(args.image_size)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(args.lr, momentum=0.9))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    balancer = hvd_balance.LoadBalancer(data, validation_data=val)
    history = model.fit(data, validation_data=val, epochs=args.epochs,
                        verbose=2 if hvd.rank() == 0 else 0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), balancer,
                                   hvd_balance.WeightedMetricAverage(data, val)])

    # The weights, moving statistics included, must be the same on every rank.
    weights = b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())
    digest = np.frombuffer(hashlib.sha256(weights).digest()[:8], np.int64)
    same_weights = len(set(hvd.allgather(digest, name="weights_digest").tolist())) == 1
    if hvd.rank() == 0:
        h = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        batches = [int(b) for b in balancer.plan.batch_sizes]
        print(f"local batches {batches} (global batch {args.global_batch}), final loss "
              f"{h['loss'][-1]:.4f}, val_accuracy {h['val_accuracy'][-1]:.4f}, every rank ends "
              f"with the same weights: {same_weights}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": hvd.size(), "global_batch": args.global_batch,
                           "local_batches": batches, "history": h,
                           "same_weights": same_weights}, f, indent=1)


if __name__ == "__main__":
    main()

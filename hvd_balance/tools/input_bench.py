"""Input benchmark: reading and decoding JPEG TFRecords, plain Horovod's shard vs BalancedData.

    python -m hvd_balance.tools.input_bench --images 8192 --reps 3 --epochs 4 \\
        --shares 1.0,0.25 --out results/input_bench.json

Writes ``--images`` JPEG-encoded ``--size`` x ``--size`` RGB images (smooth random fields,
so the JPEGs are of realistic size) with a label into ``--shards`` TFRecord files, then runs
the same 2-rank job per repetition, interleaved, under the emulated devices (``--shares``,
``hvd_balance.emulate``, root; ``--no-emulate`` runs plain horovodrun): a small CNN, global
batch ``--batch``, decoding (``tf.io.decode_jpeg``) and a random flip in the input pipeline.

* **plain**: Horovod's usual pipeline,
  ``TFRecordDataset(files).shard(size, rank).map(decode).batch(B / size)``: equal batches;
  every rank reads every record (``shard`` drops the others after reading them) and decodes
  its own.
* **balanced**: ``BalancedData.from_tfrecords(files, decode, global_batch_size=B)`` and
  ``LoadBalancer(data)``: each rank reads and decodes only its ``b_i`` records a step.

Reported per mode: the median epoch seconds (epochs 2.., the first holds the tracing and the
benchmark) and samples/s, and per rank: local batch, bytes and records read per epoch against
its own samples (read amplification: bytes read / bytes of its own records). Plain's reads
are counted from what ``TFRecordDataset`` must read (every record of the epoch, header and
CRCs included), balanced's by the record index's counters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import numpy as np

from .emulate import RANK_ENV

log = logging.getLogger(__name__)
MODES = ("plain", "balanced")
RECORD_OVERHEAD_BYTES = 16  # TFRecord framing: length, its CRC, the data's CRC


def write_images(folder: str, images: int, size: int, shards: int, seed: int = 0) -> List[str]:
    """``shards`` TFRecord files of ``images`` JPEG images with labels; their paths."""
    import tensorflow as tf

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = [os.path.join(folder, f"images-{k:03d}.tfrecord") for k in range(shards)]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    coarse = max(2, size // 8)
    for i in range(images):
        field = rng.uniform(0, 255, size=(coarse, coarse, 3)).astype("float32")
        image = tf.cast(tf.image.resize(field[None], (size, size))[0], tf.uint8)
        feature = {
            "jpeg": tf.train.Feature(bytes_list=tf.train.BytesList(
                value=[tf.io.encode_jpeg(image, quality=90).numpy()])),
            "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 10]))}
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        writers[i % shards].write(example.SerializeToString())
    for w in writers:
        w.close()
    return paths


def worker(args) -> None:
    """One training job under horovodrun; every rank writes ``{out}/rank{r}.json``."""
    import tensorflow as tf
    import hvd_balance.keras as hvd
    import hvd_balance

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    files = sorted(os.path.join(args.data, f) for f in os.listdir(args.data) if f.endswith(".tfrecord"))
    features = {"jpeg": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def decode(record):
        ex = tf.io.parse_single_example(record, features)
        image = tf.image.convert_image_dtype(tf.io.decode_jpeg(ex["jpeg"], channels=3), tf.float32)
        image = tf.image.random_flip_left_right(image)
        image.set_shape((args.size, args.size, 3))
        return image, ex["label"]

    total_records = sum(1 for _ in tf.data.TFRecordDataset(files))
    total_bytes = sum(os.path.getsize(f) for f in files)
    steps = total_records // args.batch
    balancer, data = None, None
    if args.mode == "plain":
        local = args.batch // size
        data = (tf.data.TFRecordDataset(files).shard(size, rank)
                .map(decode, num_parallel_calls=tf.data.AUTOTUNE)
                .batch(local, drop_remainder=True).take(steps).prefetch(2))
    else:
        data = hvd_balance.BalancedData.from_tfrecords(files, decode, global_batch_size=args.batch, seed=0)
        balancer = hvd_balance.LoadBalancer(data, verbose=0)
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([
        tf.keras.Input((args.size, args.size, 3)),
        tf.keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
        tf.keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(10)])
    model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    index = getattr(data, "record_index", None)

    class Clock(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.epoch_s, self.bytes_read, self.records_read, self.local = [], [], [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()
            self.read0 = (index.bytes_read, index.records_read) if index is not None else (0, 0)

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_s.append(time.perf_counter() - self.start)
            if index is not None:
                self.bytes_read.append(index.bytes_read - self.read0[0])
                self.records_read.append(index.records_read - self.read0[1])
                self.local.append(int(balancer.plan.batch_sizes[rank]))
            else:  # TFRecordDataset reads every record up to the epoch's last (take(steps))
                self.records_read.append(steps * args.batch)
                self.bytes_read.append(int(total_bytes * steps * args.batch / total_records))
                self.local.append(args.batch // size)

    clock = Clock()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), clock]
    if balancer is not None:
        callbacks.append(balancer)
    model.fit(data, epochs=args.epochs, verbose=0, callbacks=callbacks)
    own_bytes = [b * steps * (total_bytes / total_records) for b in clock.local]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"mode": args.mode, "rank": rank, "steps": steps, "epoch_s": clock.epoch_s,
                   "local_batch": clock.local, "bytes_read": clock.bytes_read,
                   "records_read": clock.records_read,
                   "own_samples": [b * steps for b in clock.local],
                   "read_amplification": [r / o for r, o in zip(clock.bytes_read, own_bytes)]}, f)


def summarise(runs: List[List[dict]], batch: int) -> dict:
    """Per mode: median epoch seconds (epochs 2..), samples/s, and each rank's last epoch."""
    out = {}
    for mode in MODES:
        mine = [ranks for ranks in runs if ranks[0]["mode"] == mode]
        if not mine:
            continue
        epoch_s = [max(r["epoch_s"][e] for r in ranks) for ranks in mine
                   for e in range(1, len(ranks[0]["epoch_s"]))]
        median = float(np.median(epoch_s))
        last = mine[-1]
        out[mode] = {"epoch_s": median, "samples_per_s": last[0]["steps"] * batch / median,
                     "runs": len(mine),
                     "ranks": [{"rank": r["rank"], "local_batch": r["local_batch"][-1],
                                "bytes_read": r["bytes_read"][-1], "records_read": r["records_read"][-1],
                                "own_samples": r["own_samples"][-1],
                                "read_amplification": r["read_amplification"][-1]} for r in last]}
    if "plain" in out and "balanced" in out:
        out["balanced"]["speedup"] = out["plain"]["epoch_s"] / out["balanced"]["epoch_s"]
    return out


def table(summary: dict) -> str:
    lines = ["| mode | local batches | epoch s | samples/s | per rank: MB read / records read / own samples (read amplification) |",
             "|---|---|---:|---:|---|"]
    for mode, s in summary.items():
        ranks = "; ".join(f"{r['bytes_read'] / 1e6:.1f} / {r['records_read']} / {r['own_samples']} "
                          f"({r['read_amplification']:.2f}x)" for r in s["ranks"])
        lines.append(f"| {mode} | {', '.join(str(r['local_batch']) for r in s['ranks'])} | "
                     f"{s['epoch_s']:.3f} | {s['samples_per_s']:.0f} | {ranks} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_balance.tools.input_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=8192, help="images written")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--shards", type=int, default=8, help="TFRecord files")
    parser.add_argument("--batch", type=int, default=256, help="global batch (samples)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shares", default="1.0,0.25", help="CPU share per rank (emulated)")
    parser.add_argument("--no-emulate", action="store_true",
                        help="plain horovodrun, no CPU quotas (no root needed; a smoke run)")
    parser.add_argument("--data", help="a folder of TFRecords written before (skips writing)")
    parser.add_argument("--out", default="results/input_bench.json")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    shares = args.shares.split(",")
    env = dict(os.environ, **RANK_ENV)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or os.path.join(tmp, "records")
        if not args.data:
            log.info("writing %d JPEG images (%dx%d) into %d TFRecord files", args.images,
                     args.size, args.size, args.shards)
            write_images(data, args.images, args.size, args.shards)
        for rep in range(args.reps):
            for mode in MODES:
                out = os.path.join(tmp, f"{mode}-{rep}")
                os.makedirs(out)
                job = [sys.executable, "-m", "hvd_balance.tools.input_bench", "--worker",
                       "--mode", mode, "--data", data, "--out", out, "--size", str(args.size),
                       "--batch", str(args.batch), "--epochs", str(args.epochs)]
                if args.no_emulate:
                    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
                    cmd = [horovodrun, "--gloo", "-np", str(len(shares)), "-H", f"localhost:{len(shares)}", *job]
                else:
                    cmd = [sys.executable, "-m", "hvd_balance.emulate", "--cpu-shares", args.shares,
                           "--", *job]
                log.info("rep %d %s", rep, mode)
                done = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
                if done.returncode != 0:
                    log.error("%s failed:\n%s", mode, done.stdout[-3000:] + done.stderr[-3000:])
                    return 1
                ranks = []
                for r in range(len(shares)):
                    with open(os.path.join(out, f"rank{r}.json")) as f:
                        ranks.append(json.load(f))
                runs.append(ranks)
    summary = summarise(runs, args.batch)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "summary": summary, "runs": runs}, f, indent=1)
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

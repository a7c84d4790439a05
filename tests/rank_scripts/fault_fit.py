"""A balanced training run in which one rank fails, for tests/multirank/test_faults.py.

Usage: horovodrun -np 2 python fault_fit.py OUT MODE [--no-watchdog]
OUT: a directory shared by the ranks (checkpoints, markers).
MODE:
    raise, kill, stop: train 4 epochs of 10 steps; rank 0 saves a weights checkpoint
        OUT/ckpt-<epoch>.weights.h5 at every epoch end and prints "CKPT <epoch> <eval loss>";
        in the middle of epoch 2 (index 1, step 5) rank 1 prints "FAULT <unix time>" and
        raises a RuntimeError, SIGKILLs itself, or SIGSTOPs itself.
    resume: every rank loads the newest checkpoint in OUT (weights and optimizer state),
        prints "LOADED <epoch> <eval loss> <optimizer steps>", trains the remaining epochs
        from there and emits its losses (``_result.emit``).
    save_interrupted: at the end of epoch 1 rank 0 writes OUT/ckpt-slow.weights.h5 slowly
        (a large checkpoint, written in place over about 1.5 s) and prints "SAVED" when done;
        rank 1 SIGKILLs itself as soon as rank 0 has started writing, so the launcher
        terminates rank 0 in the middle of the write.
--no-watchdog: do not install hvd_balance.watchdog (to see what Horovod does alone).
"""
import glob
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import tensorflow as tf
import hvd_balance.keras as hvd

import hvd_balance
from _result import emit
from hvd_balance import watchdog

hvd.init()
out, mode = sys.argv[1], sys.argv[2]
if "--no-watchdog" not in sys.argv:
    watchdog.install()
rank, size = hvd.rank(), hvd.size()
EPOCHS, FAULT_EPOCH, FAULT_STEP = 4, 1, 5

rng = np.random.default_rng(0)
x = rng.normal(size=(700, 10)).astype("float32")
y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
x_eval, y_eval = x[640:], y[640:]
data = hvd_balance.BalancedData(x[:640], y[:640], global_batch_size=64, seed=0)
tf.keras.utils.set_random_seed(1)
model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(16, activation="relu"),
                             tf.keras.layers.Dense(2)])
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(optimizer=hvd_balance.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss=loss_fn)


def eval_loss() -> float:
    return float(loss_fn(y_eval, model(x_eval, training=False)))


class Fault(tf.keras.callbacks.Callback):
    """Rank 1 fails at FAULT_STEP of epoch FAULT_EPOCH."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if rank != 1 or self.epoch != FAULT_EPOCH or batch != FAULT_STEP:
            return
        print(f"FAULT {time.time():.3f}", flush=True)
        if mode == "raise":
            raise RuntimeError("injected failure on rank 1")
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)


class ReportCheckpoint(tf.keras.callbacks.Callback):
    """On rank 0, after ModelCheckpoint: the evaluation loss of the weights just saved."""

    def on_epoch_end(self, epoch, logs=None):
        print(f"CKPT {epoch + 1} {eval_loss():.8f}", flush=True)


class SlowCheckpoint(tf.keras.callbacks.Callback):
    """Rank 0 writes a checkpoint in place, slowly, at the end of the first epoch."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch != 0:
            return
        staged = os.path.join(out, "staged.weights.h5")
        model.save_weights(staged)
        with open(staged, "rb") as f:
            payload = f.read()
        with open(os.path.join(out, "started"), "w"):
            pass
        with open(os.path.join(out, "ckpt-slow.weights.h5"), "wb") as f:
            chunks = 15
            step = -(-len(payload) // chunks)
            for i in range(chunks):
                f.write(payload[i * step:(i + 1) * step])
                f.flush()
                time.sleep(0.1)
        print(f"SAVED {len(payload)}", flush=True)


def kill_when_rank0_writes():
    marker = os.path.join(out, "started")
    while not os.path.exists(marker):
        time.sleep(0.01)
    print(f"FAULT {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd_balance.LoadBalancer(data, plan=hvd_balance.Plan.from_batch_sizes([40, 24]),
                                      verbose=0)]
if mode in ("raise", "kill", "stop"):
    callbacks.append(Fault())
    if rank == 0:
        callbacks += [tf.keras.callbacks.ModelCheckpoint(
            os.path.join(out, "ckpt-{epoch:02d}.weights.h5"), save_weights_only=True),
            ReportCheckpoint()]
    model.fit(data, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    print("FINISHED (the fault did not stop the job)", flush=True)
elif mode == "save_interrupted":
    if rank == 0:
        callbacks.append(SlowCheckpoint())
    else:
        threading.Thread(target=kill_when_rank0_writes, daemon=True).start()
    model.fit(data, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    print("FINISHED (the fault did not stop the job)", flush=True)
elif mode == "resume":
    newest = max(glob.glob(os.path.join(out, "ckpt-*.weights.h5")),
                 key=lambda p: int(re.search(r"ckpt-(\d+)", p).group(1)))
    initial_epoch = int(re.search(r"ckpt-(\d+)", newest).group(1))
    model.optimizer.build(model.trainable_variables)  # else its state is silently skipped
    model.load_weights(newest)
    print(f"LOADED {initial_epoch} {eval_loss():.8f} {int(model.optimizer.iterations.numpy())}",
          flush=True)
    data.set_epoch(initial_epoch)
    history = model.fit(data, epochs=EPOCHS, initial_epoch=initial_epoch, verbose=0,
                        callbacks=callbacks)
    emit({"rank": rank, "initial_epoch": initial_epoch,
          "epochs_run": len(history.history["loss"]),
          "loss": history.history["loss"], "eval_loss": eval_loss()})
else:
    raise SystemExit(f"unknown mode {mode!r}")

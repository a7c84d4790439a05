"""The benchmark's worker: one job on every rank (TensorFlow and Horovod imported here only)."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from ..emulate import ENV_STEP_DELAY_MS
from . import models
from .settings import (ADAM_MODELS, INPUT_DTYPE, METHOD_OF, MODELS, PAIRED_FIND_EPOCHS,
                       PAIRED_STRATEGIES, paired_order, telemetry_window)

def _model_parts(name: str, batch_norm: str = "local"):
    """``(input_shape, layers)`` of a benchmark model (``batch_norm``: ``resnet``'s
    normalization, ``"local"`` or ``"sync"``; see :mod:`.models`)."""
    import tensorflow as tf

    L = tf.keras.layers
    if name == "resnet":
        return models.IMAGE_SHAPE, models.resnet_layers(batch_norm)
    if name == "text":
        return (models.SEQ_LEN,), models.text_layers()
    if name == "cnn":
        return (16, 16, 1), [
            L.Conv2D(32, 3, padding="same", activation="relu"),
            L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPool2D(),
            L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPool2D(),
            L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)]
    if name == "mlp":
        return (256,), [L.Dense(1024, activation="relu"), L.Dense(1024, activation="relu"),
                        L.Dense(10)]
    if name == "tiny":
        return (8, 8, 1), [L.Conv2D(16, 3, padding="same", activation="relu"),
                           L.Conv2D(16, 3, padding="same", activation="relu"), L.Flatten(),
                           L.Dense(10)]
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def make_data(input_shape, samples: int, seed: int):
    """Synthetic, learnable data: Gaussian inputs, labels from a fixed random linear map."""
    return _linear_data(input_shape, samples, 0, seed)[:2]


def _linear_data(input_shape, samples: int, heldout: int, seed: int):
    """:func:`make_data`'s ``(x, y)`` and ``heldout`` more samples of the same map, drawn
    after them (so the training set is the same whatever ``heldout``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples,) + tuple(input_shape), dtype=np.float32)
    w = rng.standard_normal((int(np.prod(input_shape)), 10), dtype=np.float32)
    x_test = rng.standard_normal((heldout,) + tuple(input_shape), dtype=np.float32)

    def label(inputs):
        return np.argmax(inputs.reshape(len(inputs), len(w)) @ w, axis=1).astype("int32")

    return x, label(x), x_test, label(x_test)


def model_data(name: str, input_shape, samples: int, heldout: int, seed: int):
    """``(x, y, x_heldout, y_heldout)`` for model ``name``: the training samples and the
    held-out ones every strategy is evaluated on (the same for every strategy)."""
    if name == "resnet":
        return models.make_images(samples, heldout, seed)
    if name == "text":
        return models.make_tokens(samples, heldout, seed)
    return _linear_data(input_shape, samples, heldout, seed)


def _worker_classes():
    """The Keras classes the worker needs (defined on first use, after TF is imported)."""
    import tensorflow as tf

    from hvd_balance.keras import compat
    from hvd_balance.keras.telemetry import collective_seconds_since

    def sleep_ms(ms):
        time.sleep(float(ms) / 1e3)
        return ms

    class StepDelay(tf.keras.layers.Layer):
        """In training mode, sleep ``delay_ms`` before passing the input on: a device with a
        fixed cost per step (it is paid in ``fit`` and in the LoadBalancer's benchmark step)."""

        def __init__(self, delay_ms: float = 0.0, **kwargs):
            super().__init__(**kwargs)
            self.delay_ms = float(delay_ms)

        def call(self, inputs, training=None):
            if self.delay_ms <= 0 or training is None or training is False:
                return inputs
            done = tf.numpy_function(sleep_ms, [tf.constant(self.delay_ms, tf.float64)],
                                     tf.float64, name="step_delay")
            if tf.is_tensor(training):
                done = tf.cond(training, lambda: done, lambda: tf.constant(0.0, tf.float64))
            with tf.control_dependencies([done]):
                return tf.identity(inputs)

    class StepTiming:
        """Per-step busy and wait seconds of this rank, recorded in the compiled step.

        ``record(ready_s, end_s, layers_s)`` (in the graph) stores ``ready_s - previous end_s
        - layers_s`` as busy and ``end_s - ready_s + layers_s`` as wait, ``layers_s`` being
        the seconds spent in synchronized layers' collectives in the step (the telemetry's
        rule: a fast rank waiting for a slow one in SyncBatchNormalization is not busy);
        :meth:`start` marks an epoch's beginning and :meth:`read` returns the epoch's steps.
        """

        def __init__(self, capacity: int):
            self.capacity = int(capacity)
            self.prev_end_s = tf.Variable(0.0, dtype=tf.float64, trainable=False)
            self.busy_s = tf.Variable(tf.zeros([self.capacity], tf.float64), trainable=False)
            self.wait_s = tf.Variable(tf.zeros([self.capacity], tf.float64), trainable=False)
            self.count = tf.Variable(0, dtype=tf.int32, trainable=False)
            self.layers_seen_s = tf.Variable(0.0, dtype=tf.float64, trainable=False)

        def record(self, ready_s, end_s, layers_s):
            k = tf.minimum(self.count, self.capacity - 1)[None, None]
            ops = [self.busy_s.scatter_nd_update(k, [ready_s - self.prev_end_s - layers_s]),
                   self.wait_s.scatter_nd_update(k, [end_s - ready_s + layers_s])]
            with tf.control_dependencies(ops):
                return tf.group(self.prev_end_s.assign(end_s), self.count.assign_add(1))

        def start(self):
            self.count.assign(0)
            self.prev_end_s.assign(time.time())  # the clock tf.timestamp reads

        def read(self):
            n = min(int(self.count.numpy()), self.capacity)
            return self.busy_s.numpy()[:n].tolist(), self.wait_s.numpy()[:n].tolist()

    class TimedSequential(tf.keras.Sequential):
        """``Sequential`` whose ``train_step`` is Keras's own, with the step timed: *ready*
        when the local gradients are, before any allreduce sees them; *end* after the update."""

        step_timing: StepTiming = None

        def train_step(self, data):
            ready = {}

            def mark_ready(grads):
                flat = [g for g in tf.nest.flatten(grads, expand_composites=True) if g is not None]
                with tf.control_dependencies(flat):
                    ready["s"] = tf.timestamp()
                # after the backward pass: its allreduces were created in tape.gradient, before
                ready["layers_s"] = collective_seconds_since(self.step_timing.layers_seen_s)
                with tf.control_dependencies([ready["s"]]):
                    return [None if g is None else tf.identity(g) for g in grads]

            metrics = compat.train_step_with_ready_mark(self, data, mark_ready)
            with tf.control_dependencies([tf.convert_to_tensor(v) for v in self.trainable_variables]):
                end_s = tf.timestamp()
            with tf.control_dependencies([self.step_timing.record(ready["s"], end_s, ready["layers_s"])]):
                return tf.nest.map_structure(tf.identity, metrics)

    class StepRecorder(tf.keras.callbacks.Callback):
        """Per epoch: begin and end times (time.time()) and the step timing's busy and wait lists."""

        def __init__(self, timing: StepTiming, data, advance_epoch: bool = False):
            super().__init__()
            self.timing, self.data, self.advance_epoch = timing, data, advance_epoch

        def on_train_begin(self, logs=None):
            self.begin_at, self.end_at, self.busy_s, self.wait_s, self.loss = [], [], [], [], []
            self.local_batch = []

        def on_epoch_begin(self, epoch, logs=None):
            self.timing.start()
            self.begin_at.append(time.time())
            self.local_batch.append(self.data.local_batch_size)

        def on_epoch_end(self, epoch, logs=None):
            self.end_at.append(time.time())
            busy, wait = self.timing.read()
            self.busy_s.append(busy)
            self.wait_s.append(wait)
            self.loss.append(float((logs or {}).get("loss", float("nan"))))
            if self.advance_epoch:  # the LoadBalancer does this when there is one
                self.data.set_epoch(epoch + 1)

    class Mark(tf.keras.callbacks.Callback):
        """Records the time (``time.time()``) of its ``on_train_begin``; placed on both sides
        of the LoadBalancer, two of them time its benchmark phase on this rank."""

        at = None

        def on_train_begin(self, logs=None):
            self.at = time.time()

    return StepDelay, StepTiming, TimedSequential, StepRecorder, Mark


def run_worker(args) -> int:
    """One job on every rank; rank 0 writes ``{"ranks": [...], ...}`` to ``args.job_out``."""
    import numpy as np
    import tensorflow as tf
    import hvd_balance.keras as hvd

    import hvd_balance
    from hvd_balance.keras import collective, compat

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    delay_ms = float(os.environ.get(ENV_STEP_DELAY_MS) or 0.0)
    StepDelay, StepTiming, TimedSequential, StepRecorder, Mark = _worker_classes()
    tf.keras.utils.set_random_seed(args.seed)
    input_shape, layers = _model_parts(args.model, args.batch_norm)
    x, y, x_test, y_test = model_data(args.model, input_shape, args.samples, args.heldout, args.seed)
    window = (telemetry_window(args.samples // args.global_batch)
              if args.strategy == "telemetry" else None)
    data = hvd_balance.BalancedData(x, y, global_batch_size=args.global_batch, seed=args.seed,
                                    segment_steps=window)
    model = TimedSequential([tf.keras.Input(input_shape, dtype=INPUT_DTYPE.get(args.model, "float32")),
                             StepDelay(delay_ms), *layers])
    model.step_timing = StepTiming(data.steps)
    if args.model in ADAM_MODELS:
        base = tf.keras.optimizers.Adam(args.lr)
    else:
        base = tf.keras.optimizers.SGD(args.lr, momentum=0.9)
    compression = getattr(hvd.Compression, args.compression)  # a name in settings.COMPRESSIONS
    if args.strategy == "uniform":  # plain Horovod: equal weights, no telemetry
        optimizer = compat.horovod_optimizer(base, compression=compression)
    else:
        optimizer = hvd_balance.DistributedOptimizer(base, compression=compression)
    model.compile(optimizer=optimizer,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    balancer, before, after = None, Mark(), Mark()
    benchmark_options = dict(
        benchmark_batches=_benchmark_batches(args.benchmark_batches, args.global_batch, size),
        **({"repeats": args.benchmark_repeats} if args.benchmark_repeats else {}))
    paired, ran = None, None  # ran: a paired job's plan in its default slot
    if args.strategy in PAIRED_STRATEGIES:
        balancer, recorder, paired, ran = _paired_fit(model, data, callbacks, before, after,
                                                      benchmark_options, args, StepRecorder,
                                                      control=args.strategy == "control")
    elif args.strategy == "uniform":
        recorder = StepRecorder(model.step_timing, data, advance_epoch=True)
    else:
        balancer = hvd_balance.LoadBalancer(
            data, method=METHOD_OF[args.strategy], verbose=0, **benchmark_options,
            # balanced is LoadBalancer(data) as a user writes it: no benchmark phase (the
            # first real steps make the plan) and the default re-planning; adaptive is the
            # default before that (a benchmark, then re-planning at epoch ends)
            benchmark={"telemetry": False, "adaptive": True}.get(args.strategy),
            rebalance={"adaptive": "epoch", "telemetry": window, "proportional": "off",
                       "static": "off"}.get(args.strategy))
        recorder = StepRecorder(model.step_timing, data)
        callbacks += [before, balancer, after]
    if paired is None:
        callbacks.append(recorder)
        model.fit(_training_input(data, args), epochs=args.epochs, verbose=0, callbacks=callbacks)
    # Held-out accuracy, the same evaluation for every strategy: every rank predicts the whole
    # held-out set with its own model (the weights are the same on every rank; per-rank
    # batch-normalization statistics, with --batch-norm local, are not).
    eval_begin = time.time()
    accuracy = heldout_accuracy(model, x_test, y_test)
    eval_s = time.time() - eval_begin

    # An epoch lasts from the end of the previous one (the last step's allreduce ends on all
    # ranks together) to its own end, so it includes every rank's work between epochs; in a
    # paired job, whose epochs are separate fits, from its own beginning.
    epoch_s = [recorder.end_at[0] - recorder.begin_at[0]] + [
        b - a for a, b in zip(recorder.end_at, recorder.end_at[1:])]
    if paired is not None:
        epoch_s = [b - a for a, b in zip(recorder.begin_at, recorder.end_at)]
    mine = {"rank": rank, "local_batch": data.local_batch_size, "epoch_s": epoch_s,
            "epoch_begin_at": recorder.begin_at, "epoch_end_at": recorder.end_at,
            "busy_s": recorder.busy_s, "wait_s": recorder.wait_s, "loss": recorder.loss,
            "local_batch_per_epoch": recorder.local_batch,
            "step_delay_ms": delay_ms, "cpu_share": os.environ.get("HVD_BALANCE_CPU_SHARE"),
            "benchmark_begin_at": before.at, "benchmark_end_at": after.at,
            "accuracy": accuracy, "eval_s": eval_s}
    ranks = collective.allgather_object(mine, name="hvd_balance.bench.results")
    if rank == 0:
        # A paired job's row is its default slot's epochs: that slot's plan (the paper's in a
        # control, whose LoadBalancer's plan, the one it found, is in paired["found"]).
        plan = (ran if ran is not None else balancer.plan if balancer is not None
                else hvd_balance.Plan.uniform(args.global_batch, size))
        result = {
            "strategy": args.strategy, "world_size": size, "model": args.model,
            "global_batch": args.global_batch, "samples": args.samples, "epochs": args.epochs,
            "steps_per_epoch": data.steps, "local_batches": list(plan.batch_sizes),
            "plan": plan.to_dict(),
            # From the last rank's arrival (fit starts at different times on fast and slow
            # ranks) to the last rank's departure: what the phase itself costs the job.
            "benchmark_phase_s": (max(r["benchmark_end_at"] for r in ranks) -
                                  max(r["benchmark_begin_at"] for r in ranks))
            if balancer is not None else 0.0,
            "benchmark_phase_rank0_s": (after.at - before.at) if balancer is not None else 0.0,
            "benchmark_measure_s": plan.benchmark_s,
            "final_loss": float(np.mean([r["loss"][-1] for r in ranks])),
            "batch_norm": args.batch_norm if args.model == "resnet" else None,
            "heldout": len(y_test),
            # Rank 0's model (per-rank figures in ranks[i]["accuracy"]).
            "accuracy": ranks[0]["accuracy"],
            "replans": balancer.history if balancer is not None else [],
            "ranks": ranks,
            "paired": paired,
        }
        tmp = args.job_out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, default=str)
        os.replace(tmp, args.job_out)
    return 0


def _training_input(data, args):
    """``data`` as ``fit`` gets it: with tf.data autotuning off unless ``--tf-data-autotune``.

    With autotuning on, deleting an epoch's iterator waits for the autotune thread's sleep to
    end: seconds between epochs (see BENCHMARKS.md). The batches still come from ``data``
    (its generator reads the plan and the epoch)."""
    import tensorflow as tf

    if args.tf_data_autotune:
        return data
    options = tf.data.Options()
    options.autotune.enabled = False
    return data.with_options(options)


class _Epochs:
    """The per-epoch records of several ``fit`` calls' StepRecorders, end to end (the
    attributes ``run_worker`` reads from a StepRecorder)."""

    def __init__(self, recorders):
        for name in ("begin_at", "end_at", "busy_s", "wait_s", "loss", "local_batch"):
            setattr(self, name, [v for r in recorders for v in getattr(r, name)])


def _paired_fit(model, data, callbacks, before, after, benchmark_options, args, StepRecorder,
                control: bool = False):
    """The ``paired`` strategy: the paper's plan and the default's, found in one job and then
    compared epoch by epoch in it, so that a job's own speed (the shared machine's load when
    it ran) is the same for both.

    1. One epoch of the ``proportional`` strategy (its benchmark before ``fit``, then its
       plan): the paper's plan.
    2. ``LoadBalancer(data)`` with every default, from equal batches, until its rounds
       settle (:func:`_settled`), at most :data:`PAIRED_FIND_EPOCHS` epochs: its plan then
       is the default's.
    3. ``args.epochs`` epochs, each a ``fit`` of one epoch with the plan given and kept
       (``LoadBalancer(data, plan)``), in :func:`paired_order`.

    With ``control`` (the ``control`` strategy, an A/A test), step 3 runs the paper's plan in
    the default's epochs too: the job is the same, but its pairs compare a plan with itself,
    so their spread is the harness's own (the default's plan is still found, and recorded).

    Returns ``(the default's LoadBalancer, the epochs' records, {"paper": batches,
    "default": the batches its epochs ran, "order": each compared epoch's plan name,
    "first_compared": the index of the first compared epoch, "settled": whether the
    default's plan was judged, "control": whether the default's epochs ran the paper's plan,
    "found": the default's plan}, the plan its default slot ran)``.
    """
    import tensorflow as tf

    import hvd_balance

    class StopWhenSettled(tf.keras.callbacks.Callback):
        """Ends ``fit`` after an epoch whose round left the default's plan judged (the
        history is the same on every rank, so every rank stops at the same epoch)."""

        def on_epoch_end(self, epoch, logs=None):
            if _settled(default.history, epoch):  # never cancels a stop asked for elsewhere
                self.model.stop_training = True

    fits = []

    def fit(first_epoch, epochs, fit_callbacks):
        recorder = StepRecorder(model.step_timing, data)
        model.fit(_training_input(data, args), initial_epoch=first_epoch,
                  epochs=first_epoch + epochs, verbose=0, callbacks=[*fit_callbacks, recorder])
        fits.append(recorder)

    paper = hvd_balance.LoadBalancer(data, method="proportional", rebalance="off", verbose=0,
                                     **benchmark_options)
    fit(0, 1, [*callbacks, before, paper, after])
    default = hvd_balance.LoadBalancer(data, verbose=0)
    fit(1, PAIRED_FIND_EPOCHS, [default, StopWhenSettled()])
    first = 1 + len(fits[-1].end_at)
    plans = {"paper": paper.plan, "default": paper.plan if control else default.plan}
    order = paired_order(args.epochs)
    for k, name in enumerate(order):
        fit(first + k, 1, [hvd_balance.LoadBalancer(data, plans[name], verbose=0)])
    return default, _Epochs(fits), {
        "paper": list(plans["paper"].batch_sizes), "default": list(plans["default"].batch_sizes),
        "order": order, "first_compared": first, "settled": _settled(default.history, first - 1),
        "control": control, "found": list(default.plan.batch_sizes)}, plans["default"]


def _settled(history, epoch: int) -> bool:
    """Whether the LoadBalancer's windows up to the end of ``epoch`` left a plan its controller
    has judged and would keep: the epoch-end decision reverted a switch, or it and the
    epoch-end decision before it both kept the plan. ``False`` after a switch (judged by the
    next window's step, not yet measured) and for a window that decided nothing (too few timed
    steps: ``decision`` ``None``). The first steps' plan, made mid-epoch, is not an epoch end.

    >>> _settled([{"epoch": 1, "step": 3, "decision": "switched"},
    ...           {"epoch": 1, "step": 0, "decision": "kept"}], 1)
    False
    >>> _settled([{"epoch": 1, "step": 0, "decision": "kept"},
    ...           {"epoch": 2, "step": 0, "decision": "kept"}], 2)
    True
    >>> _settled([{"epoch": 1, "step": 0, "decision": "reverted"}], 1)
    True
    """
    rounds = [h for h in history if h["step"] == 0]
    if not rounds or rounds[-1]["epoch"] != epoch:
        return False
    if rounds[-1]["decision"] == "reverted":
        return True
    return len(rounds) >= 2 and rounds[-1]["decision"] == rounds[-2]["decision"] == "kept"


def heldout_accuracy(model, x, y, batch_size: int = 256):
    """The share of ``x`` whose largest logit is its label ``y`` (``None`` for no samples);
    inference mode (moving batch-normalization statistics, no step delay), no collective."""
    import numpy as np

    if len(y) == 0:
        return None
    logits = model.predict(x, batch_size=batch_size, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == np.asarray(y)))


def _benchmark_batches(text: Optional[str], global_batch: int, world_size: int):
    """``--benchmark-batches``: ``None`` (the LoadBalancer's default), sizes in samples, or
    fractions of ``B / N`` (``"0.5x,1x"``)."""
    if not text:
        return None
    sizes = []
    for item in text.split(","):
        item = item.strip()
        if item.endswith("x"):
            sizes.append(max(1, round(float(item[:-1]) * global_batch / world_size)))
        else:
            sizes.append(int(item))
    return sorted(set(sizes))

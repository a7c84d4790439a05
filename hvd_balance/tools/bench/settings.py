"""The benchmark's fixed settings: strategies, models, the smoke run."""

from __future__ import annotations

from ...core.controller import MIN_SAMPLES

# uniform: plain Horovod, equal batches; proportional: the paper's rule from the benchmark,
# kept (LoadBalancer(method="proportional", rebalance="off")); balanced: LoadBalancer(data)
# with every default (no benchmark phase: equal batches for the first 3 steps, then the
# plan from their busy times, re-planned at epoch ends).
STRATEGIES = ("uniform", "proportional", "balanced")  # the default set, in this order
# On request: "static", the minmax plan from the benchmark alone, never re-planned
# (LoadBalancer(rebalance="off")); "adaptive", LoadBalancer(benchmark=True,
# rebalance="epoch") (the default before the first-steps start, kept for old commands);
# "telemetry", no benchmark, equal batches first, re-planned every K steps
# (benchmark=False, rebalance=K); "paired", both plans in one job (paired_order); "control",
# the paired job's A/A control: the same job with the paper's plan in both of its slots, so its
# pairs measure the harness's own noise (what a tie of "paired" is to be read against).
ALL_STRATEGIES = STRATEGIES + ("static", "adaptive", "telemetry", "paired", "control")
PAIRED_STRATEGIES = ("paired", "control")
# Each one's summary line, "LABEL step time: ...": its pairs' ratio, the paper's step over the
# default slot's.
PAIRED_LABELS = {"paired": "paired, paper / default", "control": "control (A/A), paper / paper"}
METHOD_OF = {"proportional": "proportional", "balanced": "minmax", "static": "minmax",
             "adaptive": "minmax", "telemetry": "minmax"}


def telemetry_window(steps_per_epoch: int) -> int:
    """Steps per re-planning window of the ``telemetry`` strategy: a third of an epoch, and
    more than the LoadBalancer's minimum of timed steps in a window (``MIN_SAMPLES``)."""
    return max(MIN_SAMPLES + 1, steps_per_epoch // 3)
# A paired job lets LoadBalancer(data) find its plan for at most this many epochs: until its
# epoch-end rounds settle (worker._settled: a revert, or two rounds in a row that kept the
# plan), not on a change the last round has just adopted and never measured. 7: the
# calibration, then the paper's plan and an offload, each judged over up to two windows.
PAIRED_FIND_EPOCHS = 7


def paired_order(epochs: int):
    """Which plan each of a paired job's compared epochs runs: the default's and the paper's
    alternating in mirrored pairs, ``default paper paper default ...``, so a linear drift of
    the machine's speed favours neither. Pairs are epochs ``(0, 1), (2, 3), ...``.

    >>> paired_order(6)
    ['default', 'paper', 'paper', 'default', 'default', 'paper']
    """
    return [("default", "paper")[(k + k // 2) % 2] for k in range(int(epochs))]


MODELS = ("cnn", "mlp", "tiny", "resnet", "text")
INPUT_DTYPE = {"text": "int32"}  # a model's input dtype when it is not float32
HELDOUT = 2048  # held-out samples every strategy's accuracy is measured on
# The optimizer of each model (SGD with momentum 0.9 unless named here) and its default
# learning rate: an Embedding learns slowly under SGD (each row sees few samples), so the text
# model takes Adam, as text models usually do.
ADAM_MODELS = ("text",)
LEARNING_RATE = {"resnet": 0.05, "text": 0.003}
DEFAULT_LEARNING_RATE = 0.01
# The gradients' compression in the allreduce: Horovod's hvd.Compression by its lower-case name.
COMPRESSIONS = ("none", "fp16")

_STOP_GRACE_S = 20.0
# The smoke run's model is the CNN: the tiny one's 5 ms steps vary by a third from one step to
# the next on an emulated half core, more than the imbalance the default's first steps must see.
SMOKE = {"model": "cnn", "shares": "1.0,0.5", "reps": 1, "epochs": 2, "global_batch": 256,
         "samples": 4096}



"""Side-by-side speed benchmark: plain Horovod, the paper's rule and hvd_balance, on emulated mixed devices.

Runs the same Keras model on the same data under several strategies, each repetition of each
strategy as its own job on ranks of unequal speed (:mod:`hvd_balance.emulate`: a cgroup CPU
quota per rank, and optionally a fixed delay per training step), interleaved
``A B C A B C ...`` so a slow phase of the shared machine hits every strategy alike::

    python -m hvd_balance.bench --model cnn --shares 1.0,0.25 --reps 3 --epochs 3 \\
        --global-batch 512 --samples 25600 --benchmark-batches 0.25x,0.5x \\
        --benchmark-repeats 3 --out results/cnn_2ranks.json --plot docs/bench/cnn_2ranks.png
    hvd-balance bench --model cnn --shares 1.0,1.0 --step-delay-ms 0,20 ...
    python -m hvd_balance.bench --slowdown 1,4 --strategies uniform,balanced ...  # slow compute
    python -m hvd_balance.bench --smoke --out results/smoke.json   # one tiny repetition

Each job runs in its own session; past ``--job-timeout``, or when the driver gets SIGINT,
SIGTERM or SIGHUP, the job's launcher is stopped first (it removes its cgroups), then its
process group.

Strategies (same global batch ``B``, samples, seed, model, data pipeline and step):

- ``uniform``: plain Horovod: local batch ``B / N`` on every rank, ``hvd.DistributedOptimizer``;
- ``proportional``: the paper's rule, ``b_i`` proportional to the throughput each rank
  measures in the benchmark, kept (:class:`hvd_balance.LoadBalancer` with
  ``method="proportional", rebalance="off"``);
- ``balanced``: ``LoadBalancer(data)`` exactly as a user writes it, every default: no
  benchmark phase, equal batches for 3 steps, then batches proportional to their measured
  busy times, re-planned at epoch ends (a benchmark at the first communication-bound window);
- ``static`` (only when asked for): the minmax plan from the benchmark alone, never
  re-planned (``LoadBalancer(rebalance="off")``);
- ``adaptive`` (only when asked for): ``LoadBalancer(benchmark=True, rebalance="epoch")``,
  the default before the first-steps start (kept for older commands);
- ``telemetry`` (only when asked for): no benchmark phase; equal batches first, re-planned
  every third of an epoch from the measured busy times (``LoadBalancer(benchmark=False,
  rebalance=K)``); compare its ``run_5_epochs_s`` with balanced's;
- ``paired`` (only when asked for): the paper's plan and the default's compared inside one
  job, so that the job's own speed (the shared machine's load while it ran) is the same for
  both: one epoch of ``proportional`` (its benchmark, then its plan), then
  ``LoadBalancer(data)`` from equal batches until its epoch-end rounds settle (a revert, or
  two rounds in a row that kept the plan; at most 7 epochs; its plan then is the default's),
  then ``--epochs`` epochs (an even number) alternating the two plans, kept, in mirrored
  pairs (default, paper, paper, default, ...). Its summary line ``paired, paper / default
  step time`` is the median over pairs of the paper's median step / the default's
  (:func:`figures.paired_comparison`), with a 95 % interval of that median from 6 pairs on
  (:func:`figures.median_interval`; it takes pairs as independent, which pairs of one job
  are not quite: compare jobs too);
- ``control`` (only when asked for): ``paired``'s A/A test, the same job with the paper's plan
  in the default's epochs too (the default's plan is still found, and recorded as
  ``found``): its line ``control (A/A), paper / paper step time`` is what pairs of one plan
  give, the scale a ``paired`` figure near 1 is read on. Run both interleaved:
  ``--strategies paired,control``.

``--slowdown K0,K1,...`` (:mod:`hvd_balance.emulate`'s, docs/emulation.md) slows each
rank's compute ``k_i`` times and leaves its collectives at full speed (without ``--shares``,
no quota binds); the benchmark's own step applies the wait, before its ready timestamp, for
every strategy alike (uniform's optimizer is plain Horovod's), so it is busy time.

Models (``--model``): ``cnn`` (16x16x1 images), ``mlp`` (256 features), ``tiny`` (smoke
runs), and two realistic ones (:mod:`hvd_balance.tools.bench.models`): ``resnet``, a ResNet-8
with batch normalization on 32x32x3 images (``--batch-norm sync``:
``hvd_balance.SyncBatchNormalization``, statistics over the global batch; ``local``: Keras's
layer, per rank), and ``text``, an ``Embedding`` (sparse gradients) on token sequences. After
its epochs every job measures the held-out accuracy (``--heldout`` samples drawn like the
training ones, the same for every strategy; each rank predicts them with its own model), so
the table compares accuracy after the same epochs as well as time.

What is measured, per rank and per training step, inside the compiled step (``tf.timestamp``
ops in the model's ``train_step``, which is Keras's own; identical for all strategies):

- *busy*: from the end of the previous step's weight update to this rank's local gradients
  being ready: input pipeline, Python and Keras work between steps, forward and backward;
- *wait*: from then to the end of this step's update: the allreduce (waiting for the slower
  ranks, then the reduction itself) and the update.

(:mod:`hvd_balance.keras.telemetry` measures the same except that it counts the update as busy
time; the benchmark keeps its own per-step record because it needs every rank's value for
every step, and because uniform runs ``hvd.DistributedOptimizer``, which has no telemetry.)

A step's wall time is ``busy_i + wait_i`` on every rank. An epoch's wall time is taken from
the end of the previous epoch to the end of this one (rank 0's clock; the last step's
allreduce ends on every rank together), so it includes every rank's work between epochs.
Per job the driver keeps the medians over the steady steps and epochs (the 2nd and later;
all of them for a one-epoch run); per strategy it reports the median over repetitions, and:

- ``speedup``: median uniform epoch time / the strategy's median epoch time;
- ``ideal_speedup``: from the per-rank throughputs measured in the uniform jobs,
  ``r_i = (B / N) / busy_i``: the uniform step with no overhead takes ``max_i busy_i``, the
  ideal step (every rank busy all the time, no overhead) ``B / sum_i r_i``, so
  ``ideal_speedup = max_i busy_i * sum_i r_i / B = max_i busy_i * mean_i (1 / busy_i)``;
- ``balanced share of ideal`` (a summary line, when ``uniform`` and ``balanced`` both ran):
  balanced's speedup over uniform divided by the ideal speedup of the uniform jobs' rates
  ``r_i``, ``sum_i r_i / (N min_i r_i)`` (:func:`figures.share_of_ideal`; with ``--slowdown``
  the ideal of the factors alone, rates ``r / k_i``, is printed beside it);
- ``efficiency``: per step ``mean_i busy_i / max_i busy_i``, median over steps; and
  ``efficiency_ceiling``, the same with each rank's busy times scaled to a common median
  (what the step-to-step jitter alone leaves to a perfect plan);
- ``benchmark_phase_s``: the LoadBalancer's benchmark phase (measuring, gathering,
  planning, broadcasting), from the last rank entering it to the last leaving it;
  ``calibration_cost_s``: what the default's start from equal batches cost instead (its
  first steps' longer step times against the plan they found, :func:`figures.calibration_cost`);
  ``start_cost_s``, their sum: what finding the first plan cost; ``benchmark_share``, the
  start cost's share of the job (phase + epochs), and ``benchmark_share_5_epochs`` of a
  5-epoch run (the job's first epoch plus 4 steady ones);
- ``gap``: where a strategy's step goes against the ideal one (busy, imbalance, allreduce,
  work between epochs), and ``fixed_cost_limit``: the best step if each rank's busy time is a
  fixed cost plus a cost per sample (a line fitted over every job's batches), plus the
  measured allreduce.

The training input is ``BalancedData`` with tf.data autotuning off (``--tf-data-autotune``
turns it back on): with it on, Keras's deletion of each epoch's iterator waits for the
autotune thread, seconds between epochs on these emulated ranks (see BENCHMARKS.md).

Output: a JSON file with every job's raw per-rank, per-step figures and the summary, and a PNG
chart (per-rank busy and waiting time per step for each strategy, and the epoch times);
``--from-json`` recomputes both from a report. The driver imports no TensorFlow or Horovod;
each job runs this module with ``--worker`` under ``python -m hvd_balance.emulate``, which
needs root.
"""

from .driver import main

__all__ = ["main"]

"""``python -m hvd_balance.simulate``: simulated clusters at any scale, as tables, JSON and charts.

The simulator itself is :mod:`hvd_balance.core.simulation` (numpy only); this module adds the
scale benchmark, the report, the plot and the command line.

Example (command line; ``hvd-balance simulate`` takes the same options)::

    python -m hvd_balance.simulate --ranks 1024 --mix gpus+cpu --steps 1000 --seed 0 \\
        --out results/sim.json --plot results/sim.png
    python -m hvd_balance.simulate --scale 8,64,1024,10000,100000

Example (Python)::

    cluster = make_cluster(1024, "gpus+cpu", seed=0)
    result = simulate(cluster, steps=1000, seed=0)
    print(format_report(result))
    plot(result, "results/sim.png")
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import List, Optional, Sequence

import numpy as np

from ..core.planner import plan_batches
from ..core.controller import DEFAULT_THRESHOLD
from ..core.simulation import (DEVICES, LABELS, MIXES, STRATEGIES, benchmark_curves, make_cluster, simulate)

logger = logging.getLogger(__name__)


def _median_s(fn, repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        timings.append(time.perf_counter() - start)
    return float(np.median(timings))


def scale_benchmark(sizes: Sequence[int], mix: str = "gpus+cpu", steps: int = 200,
                    repeats: int = 5, seed: int = 0, noise: float = 0.03,
                    fixed_cost: bool = True) -> List[dict]:
    """Planning time and simulated efficiency per cluster size.

    For every N in ``sizes``: plan the benchmark curves ``repeats`` times with each method
    (the median wall-clock of :func:`plan_batches` from an (N, K, 2) array, plan object
    included), then :func:`simulate` ``steps`` steps with the default drift.

    Returns:
        One dict per size: ``ranks``, ``plan_minmax_ms``, ``plan_proportional_ms``,
        ``predicted_step_ms`` and ``efficiency`` (per strategy), ``idle_gpu_hours_per_1000_steps``.

    Example:
        >>> row = scale_benchmark([8], steps=20, repeats=1)[0]
        >>> row["ranks"], row["predicted_step_ms"]["static"] <= row["predicted_step_ms"]["proportional"]
        (8, True)
    """
    rows = []
    for n in sizes:
        cluster = make_cluster(n, mix, seed, fixed_cost=fixed_cost)
        curves = benchmark_curves(cluster, noise, seed)
        batch = 64 * n
        minmax_s = _median_s(lambda: plan_batches(curves, batch, cluster.max_batch), repeats)
        prop_s = _median_s(
            lambda: plan_batches(curves, batch, cluster.max_batch, method="proportional"), repeats)
        result = simulate(cluster, steps=steps, global_batch_size=batch, noise=noise, seed=seed,
                          curves=curves, series=False)
        logger.info("%d ranks: minmax %.2f ms, proportional %.2f ms, simulated %.1f s", n,
                    minmax_s * 1e3, prop_s * 1e3, result["timing"]["simulate_s"])
        st = result["strategies"]
        rows.append({
            "ranks": n,
            "plan_minmax_ms": minmax_s * 1e3,
            "plan_proportional_ms": prop_s * 1e3,
            "predicted_step_ms": {s: st[s]["predicted_step_s"] * 1e3 for s in STRATEGIES},
            "efficiency": {s: st[s]["efficiency"] for s in STRATEGIES},
            "idle_gpu_hours_per_1000_steps": {s: st[s]["idle_gpu_hours_per_1000_steps"] for s in STRATEGIES},
            "steps": steps,
            "replans": st["adaptive"]["replans"],
        })
    return rows


def format_report(result: dict) -> str:
    """The simulation as a readable table (every figure in it is also in ``result``)."""
    cfg, cl = result["config"], result["cluster"]
    kinds = ", ".join(f"{k} {c}" for k, c in cl["kinds"].items())
    lines = [f"simulated {cfg['ranks']} ranks ({kinds}), global batch {cfg['global_batch_size']}, "
             f"{cfg['steps']} steps, seed {cfg['seed']}",
             f"per-step noise {100 * cfg['noise']:.1f}%; "
             + (f"drift: {cfg['drift_ranks']} ranks {cfg['drift_factor']:g}x slower "
                f"from step {cfg['drift_step']}; "
                if cfg["drift_step"] >= 0 and cfg["drift_ranks"] else "no drift; ")
             + (f"adaptive re-plans every {cfg['replan_every']} steps if the predicted gain > "
                f"{100 * cfg['threshold']:g}% plus the measured variation" if cfg["replan_every"] > 0 else "adaptive never re-plans"), ""]
    head = ("strategy", "step ms", "samples/s", "efficiency", "eff. before drift", "eff. after drift",
            "idle GPU-h/1000 steps", "speedup", "re-plans")
    rows = [head]
    for s, m in result["strategies"].items():
        rows.append((LABELS[s], f"{m['step_s'] * 1e3:.1f}", f"{m['samples_per_s']:.0f}",
                     f"{m['efficiency']:.3f}", _fmt(m["efficiency_before_drift"]),
                     _fmt(m["efficiency_after_drift"]), f"{m['idle_gpu_hours_per_1000_steps']:.2f}",
                     f"{m['speedup_vs_uniform']:.2f}x", str(m["replans"])))
    lines += _table(rows)
    t = result["timing"]
    lines += ["", f"planning: minmax {t['plan_minmax_s'] * 1e3:.2f} ms, proportional "
                  f"{t['plan_proportional_s'] * 1e3:.2f} ms (one plan each)"]
    return "\n".join(lines)


def format_scale_table(rows: List[dict], command: str = "") -> str:
    """The scale benchmark as a markdown table."""
    head = ("ranks", "plan minmax ms", "plan proportional ms", "pred. step ms prop.",
            "pred. step ms hvd_balance", "eff. uniform", "eff. proportional", "eff. static",
            "eff. adaptive", "idle GPU-h/1000 steps prop. / adaptive")
    out = [head]
    for r in rows:
        e, p, idle = r["efficiency"], r["predicted_step_ms"], r["idle_gpu_hours_per_1000_steps"]
        out.append((f"{r['ranks']:,}", f"{r['plan_minmax_ms']:.2f}", f"{r['plan_proportional_ms']:.2f}",
                    f"{p['proportional']:.2f}", f"{p['static']:.2f}", f"{e['uniform']:.3f}",
                    f"{e['proportional']:.3f}", f"{e['static']:.3f}", f"{e['adaptive']:.3f}",
                    f"{_hours(idle['proportional'])} / {_hours(idle['adaptive'])}"))
    lines = [("| " + " | ".join(c for c in row) + " |") for row in out]
    lines.insert(1, "|" + "|".join("---:" for _ in head) + "|")
    return "\n".join(([command, ""] if command else []) + lines)


def _hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(rows) -> List[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def plot(result: dict, path: str) -> None:
    """Step time and balance efficiency per step, and idle GPU-hours, per strategy (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "series" not in result:
        raise ValueError("the result has no per-step series to plot; simulate with series=True")
    cfg = result["config"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [2, 2, 1]})
    smooth = max(1, cfg["steps"] // 100)
    for s, data in result["series"].items():
        for ax, key, scale in ((axes[0], "step_s", 1e3), (axes[1], "efficiency", 1.0)):
            y = np.asarray(data[key]) * scale
            if smooth > 1:
                y = np.convolve(y, np.ones(smooth) / smooth, mode="valid")
            ax.plot(np.arange(len(y)) + smooth - 1, y, label=LABELS[s], lw=1.2)
    for ax, label in ((axes[0], "step time (ms)"), (axes[1], "balance efficiency")):
        if cfg["drift_step"] >= 0 and cfg["drift_ranks"]:
            ax.axvline(cfg["drift_step"], color="grey", ls="--", lw=0.8)
        for r in result["replans"]:
            ax.axvline(r["step"], color="tab:red", ls=":", lw=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel(label + (f", mean of {smooth}" if smooth > 1 else ""))
    axes[0].set_yscale("log")
    axes[1].set_ylim(0, 1.02)
    axes[1].legend(loc="lower left", fontsize=8)
    names = list(result["strategies"])
    axes[2].bar(range(len(names)), [result["strategies"][s]["idle_gpu_hours_per_1000_steps"] for s in names],
                color=[f"C{i}" for i in range(len(names))])
    axes[2].set_xticks(range(len(names)), names, fontsize=8)
    axes[2].set_ylabel("idle GPU-hours per 1000 steps")
    kinds = ", ".join(f"{k} {c}" for k, c in result["cluster"]["kinds"].items())
    fig.suptitle(f"{cfg['ranks']} ranks ({kinds}), global batch {cfg['global_batch_size']}, "
                 f"seed {cfg['seed']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_json(data, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _sizes(text: str) -> List[int]:
    try:
        sizes = [int(s.replace("_", "")) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--scale takes comma-separated rank counts; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--scale takes rank counts >= 1; got {text!r}")
    return sizes


def build_parser(prog: str = "python -m hvd_balance.simulate") -> argparse.ArgumentParser:
    """The options of ``python -m hvd_balance.simulate`` (and ``hvd-balance simulate``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Simulate synchronous training of a heterogeneous cluster under uniform, "
                    "proportional and hvd_balance (static, adaptive) batch plans.")
    parser.add_argument("--ranks", type=int, default=1024, help="number of ranks (default 1024)")
    parser.add_argument("--mix", default="gpus+cpu",
                        help=f"device mix: one of {sorted(MIXES)} or 'kind:weight,...' over "
                             f"{sorted(DEVICES)} (default gpus+cpu)")
    parser.add_argument("--no-fixed-cost", action="store_true",
                        help="zero every device's fixed per-step cost (purely proportional devices)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps to simulate (default 1000; 200 with --scale)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="global batch in samples (default 64 per rank)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.03,
                        help="sigma of the lognormal per-step noise (default 0.03)")
    parser.add_argument("--drift-step", type=int, default=None,
                        help="step from which some ranks slow down (default steps/2; -1: none)")
    parser.add_argument("--drift-fraction", type=float, default=0.1,
                        help="fraction of ranks that slow down (default 0.1)")
    parser.add_argument("--drift-factor", type=float, default=2.0,
                        help="how many times slower they become (default 2)")
    parser.add_argument("--replan-every", type=int, default=50,
                        help="adaptive strategy's re-plan interval in steps (default 50; 0: never)")
    parser.add_argument("--threshold", "--min-gain", dest="threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="adaptive strategy's re-planning threshold, as LoadBalancer's "
                             f"(default {DEFAULT_THRESHOLD}); --min-gain is its old name")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="write a PNG plot here (not with --scale)")
    parser.add_argument("--scale", type=_sizes, metavar="N1,N2,...",
                        help="instead: the scale benchmark over these rank counts")
    parser.add_argument("--repeats", type=int, default=5,
                        help="with --scale: planning repeats; the median is reported (default 5)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m hvd_balance.simulate") -> int:
    """Command line entry point; returns the exit status (0, or 2 for a bad option).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        prog: the command's name in usage and in the recorded command
            (``"hvd-balance simulate"`` from the ``hvd-balance`` CLI).

    Example:
        >>> main(["--ranks", "8", "--steps", "20"])  # doctest: +ELLIPSIS
        simulated 8 ranks ...
        0
    """
    args = build_parser(prog).parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        if args.scale:
            steps = 200 if args.steps is None else args.steps
            rows = scale_benchmark(args.scale, args.mix, steps, args.repeats, args.seed, args.noise,
                                   fixed_cost=not args.no_fixed_cost)
            command = " ".join([prog] + (sys.argv[1:] if argv is None else list(argv)))
            print(f"mix {args.mix}, global batch 64 x ranks, {steps} steps, planning time: median of "
                  f"{args.repeats}")
            print(format_scale_table(rows))
            if args.out:
                _write_json({"command": command, "mix": args.mix, "steps": steps, "repeats": args.repeats,
                             "seed": args.seed, "rows": rows}, args.out)
            return 0
        cluster = make_cluster(args.ranks, args.mix, args.seed, fixed_cost=not args.no_fixed_cost)
        result = simulate(cluster, steps=1000 if args.steps is None else args.steps,
                          global_batch_size=args.global_batch, noise=args.noise,
                          drift_step=args.drift_step, drift_fraction=args.drift_fraction,
                          drift_factor=args.drift_factor, replan_every=args.replan_every,
                          threshold=args.threshold, seed=args.seed, series=bool(args.plot or args.out))
        result["config"]["mix"] = args.mix
        result["config"]["fixed_cost"] = not args.no_fixed_cost
    except ValueError as err:
        logger.error("%s: error: %s", prog, err)
        return 2
    print(format_report(result))
    if args.out:
        _write_json(result, args.out)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

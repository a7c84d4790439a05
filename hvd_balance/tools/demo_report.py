"""The demo's side-by-side report: one training job per strategy, compared.

Reads the ``--json`` files of ``examples/train_digits.py`` (one per strategy), prints a table
(local batches, median epoch time of the steady epochs, speedup over ``uniform``, final
held-out accuracy, per-rank busy ms per step), and writes the table as JSON and a chart as
PNG::

    python -m hvd_balance.tools.demo_report results/demo-*.json \\
        --shares 1.0,0.25 --json results/demo.json --png results/demo.png

The standard library, and matplotlib for the chart (no TensorFlow).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

from hvd_balance.tools import plotting

ORDER = ("uniform", "proportional", "balanced")  # the table's rows, then any others


def _steady(values: Sequence[Optional[float]]) -> List[float]:
    """The epochs after the first (which also builds the graphs), or the only one; figures
    not measured (None, NaN) left out."""
    values = [v for v in values if v is not None and v == v]
    return values[1:] or values


def summarize(run: Dict[str, Any]) -> Dict[str, Any]:
    """One strategy's row from its job file (without the speedup)."""
    history = run.get("history", {})
    ranks = len(run["plan"]["batch_sizes"])

    def per_rank(key):  # median over the steady epochs, per rank (None: not recorded)
        steady = [_steady(history.get(f"balance/rank{i}/{key}_ms", [])) for i in range(ranks)]
        return [statistics.median(s) if s else None for s in steady]

    accuracy = history.get("val_accuracy") or [None]
    return {"strategy": run["strategy"], "local_batches": list(run["plan"]["batch_sizes"]),
            "epoch_s": statistics.median(_steady(run["epoch_s"])),
            "epochs": len(run["epoch_s"]), "val_accuracy": accuracy[-1],
            "busy_ms": per_rank("busy"), "wait_ms": per_rank("wait")}


def compare(runs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows in the order uniform, proportional, balanced (then others), each with
    ``speedup``: uniform's epoch time over the row's (``None`` without a uniform run)."""
    rows = sorted((summarize(r) for r in runs),
                  key=lambda row: (ORDER.index(row["strategy"]) if row["strategy"] in ORDER
                                   else len(ORDER)))
    base = next((row["epoch_s"] for row in rows if row["strategy"] == "uniform"), None)
    for row in rows:
        row["speedup"] = base / row["epoch_s"] if base and row["epoch_s"] > 0 else None
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """The side-by-side table, one line per strategy."""
    header = ["strategy", "local batches", "epoch s", "speedup", "val accuracy", "busy ms/step"]
    lines = [[row["strategy"], ", ".join(map(str, row["local_batches"])),
              _fmt(row["epoch_s"], ".2f"),
              "-" if row["speedup"] is None else f"{row['speedup']:.2f}x",
              _fmt(row["val_accuracy"], ".4f"),
              " / ".join(_fmt(b, ".0f") for b in row["busy_ms"])] for row in rows]
    widths = [max(len(r[k]) for r in [header] + lines) for k in range(len(header))]
    right = {2, 3, 4}  # numbers right-aligned
    out = []
    for r in [header, ["-" * w for w in widths]] + lines:
        out.append("  ".join(c.rjust(w) if k in right else c.ljust(w)
                             for k, (c, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(out)


def plot(rows: Sequence[Dict[str, Any]], path: str, shares: Optional[Sequence[float]] = None,
         title: str = "") -> None:
    """Left: the median epoch time per strategy, labelled with the speedup. Right: every
    rank's busy (solid) and waiting (hatched) ms per step, labelled with its local batch."""
    plt = plotting.pyplot()
    names = [row["strategy"] for row in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    plotting.time_bars(ax1, names, [row["epoch_s"] for row in rows],
                       [None if r["speedup"] is None else f"{r['speedup']:.2f}x" for r in rows])
    ax1.set_ylabel("epoch s (median, epochs 2+)")
    ax1.set_title("epoch time (label: speedup over uniform)", fontsize=9)
    n_ranks = max(len(row["local_batches"]) for row in rows)
    plotting.busy_wait_bars(
        ax2, names, [row["local_batches"] for row in rows], [row["busy_ms"] for row in rows],
        [row["wait_ms"] for row in rows],
        [f"rank {i}" + (f" ({shares[i]:g} core)" if shares and i < len(shares) else "")
         for i in range(n_ranks)])
    ax2.set_title("per-rank time per step (label: local batch)", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    plotting.save(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hvd_balance.tools.demo_report",
        description="Compare the --json files of examples/train_digits.py, one per strategy.")
    parser.add_argument("runs", nargs="+", help="the per-strategy JSON files")
    parser.add_argument("--shares", help="the ranks' CPU shares, e.g. 1.0,0.25 (chart legend)")
    parser.add_argument("--json", help="write the table's rows to this file")
    parser.add_argument("--png", help="write the chart to this file")
    args = parser.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    rows = compare(runs)
    shares = [float(s) for s in args.shares.split(",")] if args.shares else None
    print(table(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"shares": shares, "rows": rows}, f, indent=1)
    if args.png:
        ranks = len(rows[0]["local_batches"])
        at = f" at CPU shares {', '.join(f'{s:g}' for s in shares)}" if shares else ""
        plot(rows, args.png, shares,
             title=f"{ranks} ranks{at}, global batch {sum(rows[0]['local_batches'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

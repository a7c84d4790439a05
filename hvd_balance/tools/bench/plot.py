"""The benchmark's chart: per-rank busy and waiting time per step, and the epoch times."""

from __future__ import annotations

import os
from typing import Any, Dict

def plot(report: Dict[str, Any], path: str) -> None:
    """Per-rank busy and waiting ms per step for each strategy, and the epoch times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = [(n, s) for n, s in report["strategies"].items() if s]
    if not strategies:
        return
    n_ranks = len(strategies[0][1]["busy_s"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / n_ranks
    for k, (name, s) in enumerate(strategies):
        for i in range(n_ranks):
            x = k + (i - (n_ranks - 1) / 2) * width
            busy, wait = s["busy_s"][i] * 1e3, s["wait_s"][i] * 1e3
            ax1.bar(x, busy, width * 0.9, color=f"C{i}")
            ax1.bar(x, wait, width * 0.9, bottom=busy, color=f"C{i}", alpha=0.3, hatch="//")
            ax1.text(x, busy + wait, str(s["local_batches"][i]), ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(range(len(strategies)), [n for n, _ in strategies])
    ax1.set_ylabel("ms per step (solid: busy, hatched: waiting)")
    ax1.set_title("per-rank busy and waiting time (label: local batch)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(n_ranks)]
    shares = report["config"]["shares"]
    ax1.legend(handles, [f"rank {i} ({shares[i]:g} core)" for i in range(n_ranks)], fontsize=7)
    times = [s["epoch_s"] for _, s in strategies]
    bars = ax2.bar(range(len(strategies)), times, color="0.6")
    for b, (_, s) in zip(bars, strategies):
        if "speedup" in s:
            ax2.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{s['speedup']:.2f}x",
                     ha="center", va="bottom", fontsize=8)
    if report.get("ideal"):
        ax2.axhline(report["ideal"]["ideal_epoch_s"], color="k", ls="--", lw=1,
                    label=f"ideal ({report['ideal']['ideal_speedup']:.2f}x)")
        ax2.legend(fontsize=7)
    ax2.set_xticks(range(len(strategies)), [n for n, _ in strategies])
    ax2.set_ylabel("epoch s (median)")
    ax2.set_title("epoch time", fontsize=9)
    cfg = report["config"]
    delays = "" if not any(cfg["step_delay_ms"]) else f", delays {','.join(f'{d:g}' for d in cfg['step_delay_ms'])} ms"
    fig.suptitle(f"{cfg['model']}, shares {','.join(f'{s:g}' for s in shares)}{delays}, "
                 f"B={cfg['global_batch']}, {cfg['reps']} reps", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)

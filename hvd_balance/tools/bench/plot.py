"""The benchmark's chart: per-rank busy and waiting time per step, and the epoch times."""

from __future__ import annotations

from typing import Any, Dict

from hvd_balance.tools import plotting


def plot(report: Dict[str, Any], path: str) -> None:
    """Per-rank busy and waiting ms per step for each strategy, and the epoch times."""
    strategies = [(n, s) for n, s in report["strategies"].items() if s]
    if not strategies:
        return
    plt = plotting.pyplot()
    names = [n for n, _ in strategies]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    shares = report["config"]["shares"]
    plotting.busy_wait_bars(
        ax1, names, [s["local_batches"] for _, s in strategies],
        [[1e3 * b for b in s["busy_s"]] for _, s in strategies],
        [[1e3 * w for w in s["wait_s"]] for _, s in strategies],
        [f"rank {i} ({share:g} core)" for i, share in enumerate(shares)])
    ax1.set_title("per-rank busy and waiting time (label: local batch)", fontsize=9)
    plotting.time_bars(ax2, names, [s["epoch_s"] for _, s in strategies],
                       [f"{s['speedup']:.2f}x" if "speedup" in s else None for _, s in strategies])
    if report.get("ideal"):
        ax2.axhline(report["ideal"]["ideal_epoch_s"], color="k", ls="--", lw=1,
                    label=f"ideal ({report['ideal']['ideal_speedup']:.2f}x)")
        ax2.legend(fontsize=7)
    ax2.set_ylabel("epoch s (median)")
    ax2.set_title("epoch time", fontsize=9)
    cfg = report["config"]
    delays = "" if not any(cfg["step_delay_ms"]) else \
        f", delays {','.join(f'{d:g}' for d in cfg['step_delay_ms'])} ms"
    fig.suptitle(f"{cfg['model']}, shares {','.join(f'{s:g}' for s in shares)}{delays}, "
                 f"B={cfg['global_batch']}, {cfg['reps']} reps", fontsize=10)
    fig.tight_layout()
    plotting.save(fig, path)

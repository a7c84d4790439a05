"""The tools' charts, drawn one way: the demo's, the benchmark's and ``hvd-balance report``'s.

matplotlib is imported only when drawing (:func:`pyplot`); rank ``i`` is drawn in colour
``C{i}`` on every chart, busy time solid and waiting time hatched.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files, no display).

    Raises:
        ModuleNotFoundError: matplotlib is not installed; the message says how to install it.
    """
    try:
        import matplotlib
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("drawing needs matplotlib: pip install matplotlib",
                                  name=err.name) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def busy_wait_bars(ax, groups: Sequence[str], batches: Sequence[Sequence[int]],
                   busy_ms: Sequence[Sequence[Optional[float]]],
                   wait_ms: Sequence[Sequence[Optional[float]]],
                   rank_labels: Sequence[str]) -> None:
    """Per group (a strategy), each rank's busy and waiting ms a step stacked, labelled with
    its local batch (samples); ``None`` draws as 0."""
    plt = pyplot()
    n_ranks = max(len(b) for b in batches)
    width = 0.8 / n_ranks
    for k, group in enumerate(batches):
        for i, batch in enumerate(group):
            x = k + (i - (n_ranks - 1) / 2) * width
            busy = (busy_ms[k][i] if i < len(busy_ms[k]) else None) or 0.0
            wait = (wait_ms[k][i] if i < len(wait_ms[k]) else None) or 0.0
            ax.bar(x, busy, width * 0.9, color=f"C{i}")
            ax.bar(x, wait, width * 0.9, bottom=busy, color=f"C{i}", alpha=0.3, hatch="//")
            ax.text(x, busy + wait, str(batch), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel("ms per step (solid: busy, hatched: waiting)")
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(n_ranks)],
              list(rank_labels)[:n_ranks], fontsize=7)


def time_bars(ax, groups: Sequence[str], seconds: Sequence[float],
              labels: Sequence[Optional[str]]) -> None:
    """One grey bar per group (an epoch's seconds), each with its label on top (a speedup)."""
    bars = ax.bar(range(len(groups)), seconds, color="0.6")
    for bar, label in zip(bars, labels):
        if label is not None:
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), list(groups))


def save(fig: Any, path: str, dpi: int = 80) -> None:
    """Write ``fig`` to ``path`` (its folder made if missing) and close it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)

"""``hvd-balance report run.jsonl --out report.png``: a picture and a summary of one run.

Reads a run's record (:mod:`hvd_balance.core.run_record`, written with
``HVD_BALANCE_HISTORY=run.jsonl``) and draws, window by window:

1. each rank's share of the global batch (switches and ranks left out or taken back marked);
2. each rank's busy and waiting time a step (ms);
3. the step measured, against the one predicted and the ideal (ms).

It prints a summary of one screen (:func:`summary`). ``--out report.html`` writes the picture
and a table of the windows in one file. matplotlib draws it (``pip install matplotlib``); the
summary needs nothing beyond the library.

Usage::

    hvd-balance report run.jsonl                       # the summary of the file's last run
    hvd-balance report run.jsonl --out report.png      # and the picture
    hvd-balance report run.jsonl --run 0 --out report.html
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

from hvd_balance.core.run_record import read_runs
from hvd_balance.tools import plotting

PROG = "hvd-balance report"


def equal_split_step_ms(window: Dict[str, Any], global_batch_size: int) -> Optional[float]:
    """The step ``window``'s ranks would take on equal local batches, in ms: the slowest rank's
    ``(B / N) / samples_per_s_i``, each rank at the rate it ran at (``None`` without rates)."""
    rates = [r["samples_per_s"] for r in window["ranks"]]
    if not rates or None in rates:
        return None  # a rank left out (or not timed) has no rate of its own this window
    return round(max(1e3 * global_batch_size / len(rates) / r for r in rates), 2)


def left_out_spans(windows: Sequence[Dict[str, Any]]) -> Dict[int, List[int]]:
    """Per rank, the window numbers (from 1) it spent left out (``{}``: none was)."""
    spans: Dict[int, List[int]] = {}
    for number, w in enumerate(windows, 1):
        for rank in w["left_out"]:
            spans.setdefault(rank, []).append(number)
    return spans


def summary(run: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of one run (a :func:`read_runs` entry): ``windows``; ``first_step_ms`` and
    ``last_step_ms`` (the first and last windows with a step measured); ``share_of_ideal``
    (the last window's and the median); ``speedup_over_equal`` (the last window's step on equal
    batches at the rates it measured, over its step measured); ``left_out`` (rank -> windows
    out); ``switches`` (decisions that changed the plan)."""
    job, windows = run["job"], run["windows"]
    timed = [w for w in windows if w["step_ms"] is not None]
    shares = [w["share_of_ideal"] for w in timed if w["share_of_ideal"] is not None]
    last = timed[-1] if timed else None
    equal = equal_split_step_ms(last, job["global_batch_size"]) if last else None
    return {"edge": job["edge"], "world_size": job["world_size"],
            "global_batch_size": job["global_batch_size"], "windows": len(windows),
            "first_step_ms": timed[0]["step_ms"] if timed else None,
            "last_step_ms": last["step_ms"] if last else None,
            "last_batches": [r["local_batch"] for r in last["ranks"]] if last else None,
            "share_of_ideal": shares[-1] if shares else None,
            "median_share_of_ideal": round(statistics.median(shares), 3) if shares else None,
            "speedup_over_equal": round(equal / last["step_ms"], 2) if equal else None,
            "left_out": {r: len(n) for r, n in left_out_spans(windows).items()},
            "switches": sum(w["decision"] in ("switched", "reverted") for w in windows)}


def summary_text(s: Dict[str, Any]) -> str:
    """:func:`summary` as lines for a person."""
    def ms(v):
        return "-" if v is None else f"{v:.1f} ms"
    lines = [f"hvd_balance run: {s['edge']}, {s['world_size']} ranks, global batch "
             f"{s['global_batch_size']}, {s['windows']} windows, {s['switches']} plan changes",
             f"  step: {ms(s['first_step_ms'])} at the start, {ms(s['last_step_ms'])} now, "
             f"local batches {s['last_batches']}"]
    if s["share_of_ideal"] is not None:
        lines.append(f"  share of the ideal step: {s['share_of_ideal']:.2f} now, median "
                     f"{s['median_share_of_ideal']:.2f} (1.0: no split of the batch does better)")
    if s["speedup_over_equal"] is not None:
        lines.append(f"  speedup over equal local batches: {s['speedup_over_equal']:.2f}x "
                     "(equal batches at the rates the last window measured)")
    for rank, n in sorted(s["left_out"].items()):
        lines.append(f"  rank {rank} was left out for {n} of {s['windows']} windows")
    return "\n".join(lines)


def draw(run: Dict[str, Any], path: str) -> None:
    """The run's three panels (see the module's docstring) as a PNG at ``path``, or as an
    HTML page with the picture and a table of the windows when ``path`` ends in ``.html``."""
    plt = plotting.pyplot()
    job, windows = run["job"], run["windows"]
    n, ranks = range(1, len(windows) + 1), range(job["world_size"])
    fig, (share, times, step) = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    fractions = [[w["ranks"][i]["local_batch"] / job["global_batch_size"] for w in windows]
                 for i in ranks]
    below = [0.0] * len(windows)
    for i in ranks:
        share.bar(n, fractions[i], 0.9, bottom=below, color=f"C{i}", label=f"rank {i}")
        below = [b + f for b, f in zip(below, fractions[i])]
    for number, w in enumerate(windows, 1):
        if w["decision"] in ("switched", "reverted"):
            share.axvline(number + 0.5, color="k", lw=0.8, ls=":")
    for rank, out in left_out_spans(windows).items():
        share.plot(out, [1.02] * len(out), "v", color=f"C{rank}", ms=5, clip_on=False)
    share.set_ylim(0, 1.05)
    share.set_ylabel("share of the global batch")
    share.set_title(f"{job['edge']}: {job['world_size']} ranks, global batch "
                    f"{job['global_batch_size']} (dotted: plan changed; v: rank left out)",
                    fontsize=9)
    share.legend(fontsize=7, loc="lower left")
    for i in ranks:
        times.plot(n, [w["ranks"][i]["busy_ms"] for w in windows], "-o", ms=3, color=f"C{i}",
                   label=f"rank {i} busy")
        times.plot(n, [w["ranks"][i]["wait_ms"] for w in windows], "--", color=f"C{i}",
                   label=f"rank {i} waiting")
    times.set_ylabel("ms a step")
    times.legend(fontsize=7, ncol=2)
    step.plot(n, [w["step_ms"] for w in windows], "-o", ms=4, label="measured")
    # a window's prediction is for the plan it chose: the next window's step
    step.plot(n[1:], [w["predicted_ms"] for w in windows[:-1]], "x", ms=6,
              label="predicted (by the window before)")
    step.plot(n, [w["ideal_step_ms"] for w in windows], "--", label="ideal (B at the summed rates)")
    step.set_ylabel("step ms")
    step.set_xlabel("window")
    step.xaxis.get_major_locator().set_params(integer=True)
    step.legend(fontsize=7)
    fig.tight_layout()
    if not path.endswith(".html"):
        plotting.save(fig, path, dpi=110)
        return
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page(run, base64.b64encode(png.getvalue()).decode()))


def page(run: Dict[str, Any], png_base64: str) -> str:
    """The HTML page: the summary, the picture and one table row a window."""
    head = ["window", "epoch", "step", "local batches", "busy ms", "wait ms", "step ms",
            "ideal ms", "share", "decision"]
    rows = []
    for number, w in enumerate(run["windows"], 1):
        cells = [number, w["epoch"], w["step"], [r["local_batch"] for r in w["ranks"]],
                 [r["busy_ms"] for r in w["ranks"]], [r["wait_ms"] for r in w["ranks"]],
                 w["step_ms"], w["ideal_step_ms"], w["share_of_ideal"], w["decision"]]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return ("<!doctype html><meta charset='utf-8'><title>hvd_balance run</title>"
            f"<pre>{html.escape(summary_text(summary(run)))}</pre>"
            f"<img alt='the run' src='data:image/png;base64,{png_base64}'>"
            "<table border=1 cellspacing=0 cellpadding=3><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("record", metavar="RUN.jsonl", help="a run's record (HVD_BALANCE_HISTORY)")
    parser.add_argument("--run", type=int, default=-1, metavar="K",
                        help="which run of the file, from 0 (default: the last)")
    parser.add_argument("--out", metavar="PATH", help="write the picture: .png, or .html with a table")
    args = parser.parse_args(argv)
    try:
        runs = read_runs(args.record)
    except (OSError, ValueError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    if not runs:
        print(f"{PROG}: {args.record} holds no run (no job line)", file=sys.stderr)
        return 1
    if not -len(runs) <= args.run < len(runs):
        print(f"{PROG}: --run {args.run}: {args.record} holds {len(runs)} run(s)", file=sys.stderr)
        return 1
    run = runs[args.run]
    print(summary_text(summary(run)))
    if args.out:
        if not run["windows"]:
            print(f"{PROG}: the run has no window yet: nothing to draw", file=sys.stderr)
            return 1
        try:
            draw(run, args.out)
        except ModuleNotFoundError as err:  # matplotlib: the message says how to install it
            print(f"{PROG}: {err}", file=sys.stderr)
            return 1
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

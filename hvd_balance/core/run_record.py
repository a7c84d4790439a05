"""The run's record: one JSON line per window, appended by rank 0 (framework-free).

With ``HVD_BALANCE_HISTORY=run.jsonl`` in the environment (or ``history_file=`` on the balancer
or the strategy), rank 0 appends to that file a line about the job when training starts, then
one line per window (:mod:`.window_record`), each flushed as it is written: a run that crashes
keeps every window before the crash, and several runs appended to one file stay apart.

A window's line holds, per rank, its ``host``, ``device``, ``local_batch`` (samples),
``busy_ms``, ``wait_ms`` and ``samples_per_s`` (its local batch over its busy time); the step
measured (``step_ms``) and predicted, the decision, the ranks left out, and the ideal step::

    ideal_step_ms = 1e3 * B / sum_i(samples_per_s_i)     (the ranks that train)
    share_of_ideal = ideal_step_ms / step_ms

the global batch at the ranks' summed rates: the step no split of ``B`` over these ranks beats
while each rank's rate holds.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence

ENV = "HVD_BALANCE_HISTORY"
SCHEMA = 1  # bumped when a field changes meaning


def history_path(given: Optional[str]) -> Optional[str]:
    """The record's path: ``given``, else ``$HVD_BALANCE_HISTORY``, else ``None`` (none kept).

    Raises:
        TypeError: ``given`` is not a path.
    """
    if given is not None and not isinstance(given, (str, os.PathLike)):
        raise TypeError(f"history_file must be a path; got {given!r}")
    return os.fspath(given) if given is not None else os.environ.get(ENV) or None


def window_line(record: Dict[str, Any], global_batch_size: int, hosts: Sequence[str] = (),
                devices: Sequence[str] = (), now: Optional[float] = None) -> Dict[str, Any]:
    """The line of one window's ``record`` (a :func:`.window_record.window_record`).

    Example:
        >>> from hvd_balance.core.window_record import window_record
        >>> r = window_record(1, 0, [96, 32], [0.096, 0.064], [0.0, 0.032], [0.1, 0.1],
        ...                   [0.01, 0.01])
        >>> line = window_line(r, 128, ["a", "b"], ["cpu", "cpu"], now=0.0)
        >>> [rank["samples_per_s"] for rank in line["ranks"]], line["ideal_step_ms"]
        ([1000.0, 500.0], 85.33)
        >>> line["share_of_ideal"]
        0.853
    """
    batches = record["batch_sizes"]
    ranks = []
    for i, b in enumerate(batches):
        busy = record["busy_ms"][i]
        ranks.append({"rank": i, "host": hosts[i] if i < len(hosts) else None,
                      "device": devices[i] if i < len(devices) else None, "local_batch": b,
                      "busy_ms": busy, "wait_ms": record["wait_ms"][i],
                      "samples_per_s": round(1e3 * b / busy, 1) if b and busy else None})
    rates = [r["samples_per_s"] for r in ranks if r["local_batch"]]
    ideal = (round(1e3 * global_batch_size / sum(rates), 2)
             if rates and None not in rates else None)
    step = record["step_ms"]
    return {"record": "window", "time": time.time() if now is None else now,
            "epoch": record["epoch"], "step": record["step"], "ranks": ranks,
            "step_ms": step, "predicted_ms": record["predicted_ms"],
            "decision": record["decision"], "variation": record["variation"],
            "efficiency": record["efficiency"],
            "left_out": [i for i, b in enumerate(batches) if not b],
            "leave_out": record["leave_out"], "next_batch_sizes": record["next_batch_sizes"],
            "ideal_step_ms": ideal,
            "share_of_ideal": round(ideal / step, 3) if ideal and step else None}


PREFIX = "balance/"  # TensorBoard groups a run's scalars by the part before "/"
PER_RANK = ("local_batch", "busy_ms", "wait_ms", "samples_per_s")


def scalars(line: Dict[str, Any]) -> Dict[str, float]:
    """A window's ``line`` as named numbers for a logger: ``balance/step_ms``,
    ``balance/ideal_step_ms``, ``balance/share_of_ideal``, ``balance/efficiency`` and, per rank
    ``i``, ``balance/rank{i}/local_batch`` (samples), ``.../busy_ms``, ``.../wait_ms`` and
    ``.../samples_per_s``: the same names every window (a logger such as ``CSVLogger`` keeps
    the first window's), NaN for a figure the window did not measure.

    Example:
        >>> line = {"step_ms": 41.2, "ideal_step_ms": 38.0, "share_of_ideal": 0.922,
        ...         "efficiency": None, "ranks": [{"local_batch": 401, "busy_ms": 40.1,
        ...         "wait_ms": 1.1, "samples_per_s": None}]}
        >>> scalars(line)["balance/rank0/local_batch"], scalars(line)["balance/efficiency"]
        (401.0, nan)
    """
    def number(v):
        return math.nan if v is None else float(v)
    out = {PREFIX + k: number(line[k])
           for k in ("step_ms", "ideal_step_ms", "share_of_ideal", "efficiency")}
    for i, rank in enumerate(line["ranks"]):
        out.update({f"{PREFIX}rank{i}/{k}": number(rank[k]) for k in PER_RANK})
    return out


def window_text(number: int, line: Dict[str, Any]) -> str:
    """One line for a person (``verbose=2``) about window ``number``'s ``line``.

    Example:
        >>> window_text(7, {"step_ms": 41.2, "ideal_step_ms": 38.0, "share_of_ideal": 0.922,
        ...                 "ranks": [{"local_batch": 401}, {"local_batch": 111}],
        ...                 "decision": "kept", "next_batch_sizes": None})
        'hvd_balance: window 7: step 41.2 ms (ideal 38.0, 0.92 of it), batches [401, 111], kept'
    """
    step = "no step timed" if line["step_ms"] is None else f"step {line['step_ms']} ms"
    if line["ideal_step_ms"] is not None and line["share_of_ideal"] is not None:
        step += f" (ideal {line['ideal_step_ms']}, {line['share_of_ideal']:.2f} of it)"
    batches = [r["local_batch"] for r in line["ranks"]]
    decision = line["decision"] or "no decision"
    if line["next_batch_sizes"] is not None and list(line["next_batch_sizes"]) != batches:
        decision += f" -> {list(line['next_batch_sizes'])}"
    return f"hvd_balance: window {number}: {step}, batches {batches}, {decision}"


class RunRecord:
    """Rank 0's end of the record: a line for the job, then one a window, appended.

    Args:
        path: the JSON-lines file, opened for appending at once (made if missing), so a path
            that cannot be written fails before training.

    Raises:
        OSError: the file cannot be opened for appending (its folder missing, no permission).
    """

    def __init__(self, path: str):
        self.path, self.started = path, False
        self._file = open(path, "a", encoding="utf-8")

    def start(self, job: Dict[str, Any]) -> None:
        """Append the job's line: ``edge`` ("keras", "torch", "keras-torch", "lightning"),
        ``world_size``, ``global_batch_size`` (samples), ``hosts``, ``devices``, ``versions``."""
        self.started = True
        self._write({"record": "job", "schema": SCHEMA, "time": time.time(), **job})

    def window(self, line: Dict[str, Any]) -> None:
        """Append a window's ``line`` (:func:`window_line`), after the job's."""
        self._write(line)

    def _write(self, line: Dict[str, Any]) -> None:
        if not self._file.closed:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_runs(path: str) -> List[Dict[str, Any]]:
    """Every run in a record file: ``[{"job": {...}, "windows": [...]}, ...]``, oldest first.

    A last line cut short (a crash mid-write) is left out; a bad line elsewhere raises a
    ``ValueError`` naming the file and the line.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    runs: List[Dict[str, Any]] = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: cut short as it was written
                break
            raise ValueError(f"{path}, line {number}: not a JSON line of a run record ({err})")
        kind = line.get("record") if isinstance(line, dict) else None
        if kind == "job":
            runs.append({"job": line, "windows": []})
        elif kind == "window" and runs:
            runs[-1]["windows"].append(line)
        else:
            raise ValueError(f"{path}, line {number}: expected a job or a window line after a "
                             f"job line; got {text[:80]!r}")
    return runs

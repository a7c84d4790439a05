"""The Plan: each rank's local batch and gradient weight, what they were made from, and its file.

A :class:`Plan` is saved as YAML and loaded back strictly, by one parser that also checks
plans given as dicts (:meth:`Plan.from_dict`).

A plan file lets a later run reuse a plan and skip the benchmark. It holds the world size,
the global batch, and per rank its host, device, measured time curve, local batch, weight
and cap (and floor, when it has one), plus the versions it was made with. Example (``format_version: 1``)::

    # hvd_balance plan: `hvd-balance show plan.yaml`, or Plan.load("plan.yaml")
    format_version: 1
    made_with: {hvd_balance: 0.1.0, python: 3.11.9, tensorflow: 2.15.1, horovod: 0.28.1}
    created: '2025-01-31T12:00:00Z'
    method: minmax
    world_size: 2
    global_batch_size: 64
    benchmark_s: 3.5
    predicted_makespan_s: 0.0412
    ranks:
    - rank: 0
      host: node1
      device: gpu:0 (NVIDIA A100-SXM4-80GB)
      local_batch: 48
      weight: 0.75
      max_batch_size: 512
      min_batch_size: 16
      predicted_step_s: 0.0412
      curve:
      - [8, 0.0121]
      - [32, 0.0290]

Reading uses safe YAML loading only, and refuses more than that: YAML tags that would
construct objects, anchors and aliases (``&a`` / ``*a``, the "billion laughs"), duplicate
keys, unknown keys, wrong types, non-finite numbers, local batches below 1 or their floor
or above their cap, a floor above its cap, a weight that is not ``local_batch / global_batch_size``, and a rank list that does
not match ``world_size`` (a truncated file). Every refusal is a ``ValueError`` that names
the file and the offending entry, e.g. ``plan file 'p.yaml': ranks[2].local_batch must be
an integer >= 0; got -4``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

Points = Tuple[Tuple[int, float], ...]


class PlanMismatchError(ValueError):
    """A plan does not fit the running job (world size, global batch, hosts)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Local batch sizes for every rank of one job, immutable and identical on all ranks.

    Attributes:
        batch_sizes: local batch of each rank, in samples; sums to ``global_batch_size``.
        global_batch_size: ``B``, samples per synchronous step over all ranks.
        method: how it was made: ``"minmax"``, ``"proportional"`` or ``"given"``.
        curves: per rank, the measured ``(local_batch, seconds_per_step)`` points it was
            planned from (empty for a given plan).
        max_batch_sizes: per-rank caps in samples (``None``: no caps).
        predicted_step_s: per rank, the predicted seconds per step at its local batch
            (empty for a given plan).
        hosts, devices: per rank, where it runs (empty when unknown).
        benchmark_s: seconds spent measuring the curves (0 for a given plan).
        min_batch_sizes: per-rank floors in samples, the smallest local batch the planner
            was allowed (``None``: no floors, i.e. 1); a re-plan keeps them.

    Example:
        >>> plan = Plan.from_batch_sizes([5, 17, 42])
        >>> plan.world_size, plan.global_batch_size, plan.weights[0]
        (3, 64, 0.078125)
    """

    batch_sizes: Tuple[int, ...]
    global_batch_size: int
    method: str = "given"
    curves: Tuple[Points, ...] = ()
    max_batch_sizes: Optional[Tuple[Optional[int], ...]] = None
    predicted_step_s: Tuple[float, ...] = ()
    hosts: Tuple[str, ...] = ()
    devices: Tuple[str, ...] = ()
    benchmark_s: float = 0.0
    min_batch_sizes: Optional[Tuple[Optional[int], ...]] = None

    def __post_init__(self):
        sizes = tuple(self.batch_sizes)
        for i, b in enumerate(sizes):  # 0: the rank is left out (no step, no collective)
            if isinstance(b, bool) or not float(b).is_integer() or b < 0:
                raise ValueError(f"plan batch_sizes[{i}] must be an integer >= 0; got {b!r}")
        if sizes and not any(sizes):
            raise ValueError("plan batch_sizes are all 0: at least one rank must train")
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in sizes))
        if sum(self.batch_sizes) != self.global_batch_size:
            raise ValueError(
                f"plan batch_sizes {list(self.batch_sizes)} add up to {sum(self.batch_sizes)}, "
                f"not the global batch {self.global_batch_size}")
        for name in ("curves", "predicted_step_s", "hosts", "devices"):
            value = tuple(getattr(self, name))
            if value and len(value) != self.world_size:
                raise ValueError(f"plan {name} has {len(value)} entries for {self.world_size} ranks")
            object.__setattr__(self, name, value)

    @classmethod
    def from_batch_sizes(cls, batch_sizes: Sequence[int], **info) -> "Plan":
        """A plan with the given local batches; the global batch is their sum."""
        sizes = list(batch_sizes)
        if not sizes:
            raise ValueError("from_batch_sizes needs one batch size per rank; got []")
        return cls(batch_sizes=tuple(sizes), global_batch_size=sum(int(b) for b in sizes), **info)

    @classmethod
    def uniform(cls, global_batch_size: int, world_size: int) -> "Plan":
        """Equal shares of ``global_batch_size`` (the first ranks take the remainder)."""
        if global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is smaller than the number of ranks "
                f"({world_size}): every rank needs at least one sample per step")
        base, extra = divmod(int(global_batch_size), int(world_size))
        return cls.from_batch_sizes([base + (i < extra) for i in range(world_size)], method="uniform")

    def with_floors(self, min_batch_sizes) -> "Plan":
        """This plan with per-rank floors (``min_batch_sizes``: one int for every rank, or one
        entry per rank, in samples) that later re-plans keep; ``None`` returns it unchanged.

        Raises:
            ValueError: a local batch below its floor (naming the rank), or a floor that is
                not an integer >= 1 or a list of one per rank.
        """
        if min_batch_sizes is None:
            return self
        if isinstance(min_batch_sizes, (list, tuple)):
            floors = list(min_batch_sizes)
        else:
            floors = [min_batch_sizes] * self.world_size
        return Plan.from_dict({**self.to_dict(), "min_batch_sizes": floors})

    @property
    def world_size(self) -> int:
        return len(self.batch_sizes)

    @property
    def left_out(self) -> Tuple[int, ...]:
        """The ranks with no samples: they take no step and no part in its collectives."""
        return tuple(i for i, b in enumerate(self.batch_sizes) if b == 0)

    def require_every_rank(self, where: str) -> "Plan":
        """The plan itself; a ValueError naming the ranks it leaves out, for an edge where
        every rank takes every step (Horovod's: its process sets are fixed at ``init``)."""
        if self.left_out:
            out = ", ".join(map(str, self.left_out))
            raise ValueError(f"{where}: the plan leaves rank(s) {out} out (0 samples), which "
                             f"Horovod cannot: every rank keeps one sample or more; launch the "
                             f"job without them instead")
        return self

    @property
    def weights(self) -> Tuple[float, ...]:
        """Gradient weight of each rank, ``b_i / B`` (they sum to 1)."""
        return tuple(b / self.global_batch_size for b in self.batch_sizes)

    @property
    def predicted_makespan_s(self) -> Optional[float]:
        """Predicted seconds of one synchronous step (the slowest rank), if known."""
        return max(self.predicted_step_s) if self.predicted_step_s else None

    def check(self, world_size: int, global_batch_size: Optional[int] = None,
              hosts: Optional[Sequence[str]] = None) -> "Plan":
        """Raise :class:`PlanMismatchError` naming what differs from the running job.

        Args:
            world_size: the job's number of ranks.
            global_batch_size: the job's global batch (``None``: not checked).
            hosts: the job's host of each rank, in rank order (``None``, or a plan made
                without hosts: not checked).

        Returns:
            The plan itself, so ``plan = Plan.load(path).check(...)`` reads naturally.
        """
        problems = self.mismatches(world_size, global_batch_size, hosts)
        if problems:
            raise PlanMismatchError("the plan does not fit this job: " + "; ".join(problems))
        return self

    def mismatches(self, world_size: int, global_batch_size: Optional[int] = None,
                   hosts: Optional[Sequence[str]] = None) -> List[str]:
        """What differs from the running job, one sentence each (empty when it fits)."""
        problems = []
        if self.world_size != world_size:
            problems.append(f"it is for {self.world_size} ranks, the job has {world_size}")
        if global_batch_size is not None and self.global_batch_size != global_batch_size:
            problems.append(
                f"its global batch is {self.global_batch_size}, the job's is {global_batch_size}")
        if hosts is not None and self.hosts:
            hosts = tuple(str(h) for h in hosts)
            if len(hosts) != world_size:
                problems.append(f"the job's host list has {len(hosts)} entries for {world_size} ranks")
            elif self.world_size == world_size and hosts != self.hosts:
                diff = [f"rank {i}: plan host {a!r}, job host {b!r}"
                        for i, (a, b) in enumerate(zip(self.hosts, hosts)) if a != b]
                text = "; ".join(diff[:5])
                if len(diff) > 5:
                    text += f"; and {len(diff) - 5} more ranks"
                if sorted(hosts) == sorted(self.hosts):
                    text += ("; the same hosts in another order: launch the ranks in the order "
                             "the plan was made with")
                problems.append(f"its hosts differ ({text})")
        return problems

    def save(self, path: str) -> str:
        """Write the plan to a YAML plan file (atomically); returns ``path``.

        The file holds each rank's host, device, time curve, local batch, weight and cap,
        and the versions of hvd_balance, TensorFlow and Horovod it was made with; see
        the module docstring. Call it on rank 0 only.

        Example:
            >>> plan.save("plan.yaml")  # doctest: +SKIP
            >>> Plan.load("plan.yaml", world_size=4, global_batch_size=256)  # doctest: +SKIP
        """
        return save(self, path)

    @classmethod
    def load(cls, path: str, world_size: Optional[int] = None,
             global_batch_size: Optional[int] = None,
             hosts: Optional[Sequence[str]] = None) -> "Plan":
        """Read a plan file written by :meth:`save`, and check it against the job if asked.

        Args:
            path: the plan file.
            world_size, global_batch_size, hosts: the running job; when ``world_size`` is
                given the plan is checked as by :meth:`check`.

        Raises:
            ValueError: the file is missing, not valid YAML, or not a valid plan (the
                message names the file and the entry).
            PlanMismatchError: the plan does not fit the job; the message names the file
                and every difference, e.g. ``rank 2: plan host 'a', job host 'b'``.
        """
        plan = load(path)
        if world_size is None:
            if global_batch_size is not None or hosts is not None:
                raise ValueError("Plan.load: pass world_size to check global_batch_size or hosts")
            return plan
        problems = plan.mismatches(world_size, global_batch_size, hosts)
        if problems:
            raise PlanMismatchError(f"plan file {str(path)!r} does not fit this job: " + "; ".join(problems))
        return plan

    def to_dict(self) -> dict:
        """Plain types only (lists, numbers, strings), for broadcasting and YAML."""
        d = dataclasses.asdict(self)
        d["batch_sizes"] = list(self.batch_sizes)
        d["curves"] = [[list(p) for p in c] for c in self.curves]
        d["max_batch_sizes"] = None if self.max_batch_sizes is None else list(self.max_batch_sizes)
        d["min_batch_sizes"] = None if self.min_batch_sizes is None else list(self.min_batch_sizes)
        for k in ("predicted_step_s", "hosts", "devices"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """Inverse of :meth:`to_dict`, checked by the plan file's parser (the one set of rules).

        Raises:
            ValueError: naming the field, e.g. ``plan: ranks[1].local_batch must be an
                integer >= 1; got 0``.
        """
        try:
            return _from_data(_file_layout(d)).plan
        except ValueError as err:
            raise ValueError(f"plan: {err}") from None

    def table(self, samples_per_s: Optional[Sequence[float]] = None) -> str:
        """A readable table: rank, host, device, samples/s, local batch, weight, predicted step.

        ``min batch`` and ``max batch`` columns are added when the plan has floors or caps.
        """
        capped = self.max_batch_sizes is not None
        floored = self.min_batch_sizes is not None
        rows = [("rank", "host", "device", "samples/s", "local batch", "weight", "pred. step ms")
                + (("min batch",) if floored else ()) + (("max batch",) if capped else ())]
        for i, b in enumerate(self.batch_sizes):
            rate = samples_per_s[i] if samples_per_s is not None else None
            if rate is None and self.curves:
                pts = self.curves[i]
                rate = pts[-1][0] / pts[-1][1] if pts else None
            step = self.predicted_step_s[i] * 1e3 if self.predicted_step_s else None
            row = (str(i), self.hosts[i] if self.hosts else "-",
                   self.devices[i] if self.devices else "-",
                   "-" if rate is None else f"{rate:.1f}", str(b), f"{b / self.global_batch_size:.4f}",
                   "-" if step is None else f"{step:.2f}")
            if floored:
                floor = self.min_batch_sizes[i]
                row += ("-" if floor is None else str(floor),)
            if capped:
                cap = self.max_batch_sizes[i]
                row += ("-" if cap is None else str(cap),)
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        left = {1, 2}  # host and device read better left-aligned
        lines = ["  ".join(v.ljust(w) if c in left else v.rjust(w)
                           for c, (v, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        head = (f"plan ({self.method}): {self.world_size} ranks, global batch {self.global_batch_size}")
        if self.predicted_makespan_s is not None:
            head += f", predicted step {self.predicted_makespan_s * 1e3:.2f} ms"
        if self.benchmark_s:
            head += f", benchmark {self.benchmark_s:.2f} s"
        return "\n".join([head] + lines)


# ----------------------------------------------------------------------------------------
# The plan file: YAML written in full, read strictly.

FORMAT_VERSION = 1

_TOP_KEYS = ("format_version", "made_with", "created", "method", "world_size", "global_batch_size",
             "benchmark_s", "predicted_makespan_s", "ranks")
_RANK_KEYS = ("rank", "host", "device", "local_batch", "weight", "max_batch_size",
              "min_batch_size", "predicted_step_s", "curve")
_WEIGHT_RTOL = 1e-6

# Distribution names that provide each module, first match wins.
_DISTRIBUTIONS = {
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos",
                   "tensorflow-intel", "tf-nightly"),
    "horovod": ("horovod",),
    "numpy": ("numpy",),
}


@dataclasses.dataclass(frozen=True)
class PlanFile:
    """What a plan file holds: the plan and where it came from.

    Attributes:
        plan: the :class:`Plan`.
        format_version: the file format's version (``FORMAT_VERSION`` when written now).
        made_with: package name -> version string of the run that wrote it.
        created: ISO 8601 UTC time it was written (``""`` when the file has none).
        path: the file read (``""`` for text parsed directly).
    """

    plan: Plan
    format_version: int = FORMAT_VERSION
    made_with: Dict[str, str] = dataclasses.field(default_factory=dict)
    created: str = ""
    path: str = ""


def versions() -> Dict[str, str]:
    """Versions of hvd_balance, Python, TensorFlow, Horovod and numpy, where installed.

    A module already imported reports its ``__version__``; otherwise the installed
    distribution's metadata is read, so TensorFlow is never imported just for this.
    """
    from importlib import metadata

    out = {}
    try:
        from .._version import __version__ as own
    except ImportError:  # pragma: no cover - the package always defines it today
        own = None
    if own is None:
        try:
            own = metadata.version("hvd_balance")
        except metadata.PackageNotFoundError:
            own = "unknown"
    out["hvd_balance"] = str(own)
    out["python"] = platform.python_version()
    for module, dists in _DISTRIBUTIONS.items():
        version = getattr(sys.modules.get(module), "__version__", None)
        for dist in dists:
            if version:
                break
            try:
                version = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        if version:
            out[module] = str(version)
    return out


class _NoAliasDumper(yaml.SafeDumper):
    """Writes every value in full: a plan file never contains anchors or aliases."""

    def ignore_aliases(self, data):
        return True


class _StrictLoader(yaml.SafeLoader):
    """Safe loading, minus anchors/aliases (and so merge keys), and with duplicate keys refused."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "anchors and aliases (&name / *name) are not allowed in a plan file",
                event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"a key must be a plain value; got {type(key).__name__}",
                        key_node.start_mark) from None
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def to_yaml(plan: Plan, made_with: Optional[Dict[str, str]] = None,
            created: Optional[str] = None) -> str:
    """The plan as plan-file YAML text (see the module docstring for the layout)."""
    if created is None:
        created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    top: Dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "made_with": dict(versions() if made_with is None else made_with),
        "created": created,
        "method": plan.method,
        "world_size": plan.world_size,
        "global_batch_size": plan.global_batch_size,
        "benchmark_s": float(plan.benchmark_s),
    }
    if plan.predicted_makespan_s is not None:
        top["predicted_makespan_s"] = float(plan.predicted_makespan_s)
    ranks = []
    for i, b in enumerate(plan.batch_sizes):
        r: Dict[str, Any] = {"rank": i}
        if plan.hosts:
            r["host"] = str(plan.hosts[i])
        if plan.devices:
            r["device"] = str(plan.devices[i])
        r["local_batch"] = int(b)
        r["weight"] = b / plan.global_batch_size
        if plan.max_batch_sizes is not None:
            cap = plan.max_batch_sizes[i]
            r["max_batch_size"] = None if cap is None else int(cap)
        if plan.min_batch_sizes is not None:
            floor = plan.min_batch_sizes[i]
            r["min_batch_size"] = None if floor is None else int(floor)
        if plan.predicted_step_s:
            r["predicted_step_s"] = float(plan.predicted_step_s[i])
        if plan.curves:
            r["curve"] = [[int(lb), float(t)] for lb, t in plan.curves[i]]
        ranks.append(r)
    top["ranks"] = ranks
    body = yaml.dump(top, Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=None,
                     allow_unicode=True, width=120)
    return "# hvd_balance plan: `hvd-balance show <file>`, or Plan.load(<file>)\n" + body


def save(plan: Plan, path: str, made_with: Optional[Dict[str, str]] = None) -> str:
    """Write ``plan`` to ``path`` atomically (a reader never sees half a file); returns the path."""
    text = to_yaml(plan, made_with=made_with)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".yaml.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def read(path: str) -> PlanFile:
    """Read and validate a plan file; ``ValueError`` naming the file and the problem."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise ValueError(f"cannot read plan file {path!r}: {err.strerror or err}") from None
    return parse(raw, source=path)


def load(path: str) -> Plan:
    """The :class:`Plan` in a plan file (see :func:`read`)."""
    return read(path).plan


def parse(text, source: str = "") -> PlanFile:
    """Validate plan-file text (``str`` or UTF-8 ``bytes``); ``source`` names it in errors."""
    data = load_yaml(text, source)
    try:
        return _from_data(data, path=source)
    except ValueError as err:
        where = f"plan file {source!r}" if source else "plan text"
        raise ValueError(f"{where}: {err}") from None


def load_yaml(text, source: str = "", what: str = "plan file"):
    """Strict safe loading of YAML (or JSON) text: plain data only, see :class:`_StrictLoader`.

    Raises:
        ValueError: naming ``source`` and the problem (a tag, an alias, a duplicate key,
            invalid or truncated YAML, text that is not UTF-8).
    """
    where = f"{what} {source!r}" if source else f"{what} text"
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: see _StrictLoader
    except UnicodeDecodeError as err:
        raise ValueError(f"{where} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.constructor.ConstructorError as err:
        problem = err.problem or ""
        if "could not determine a constructor" in problem:
            tag = problem.split("tag", 1)[-1].strip(" '")
            raise ValueError(
                f"{where}: YAML tag {tag!r} is not allowed (safe loading only: plain data, "
                f"no objects){_mark(err)}") from None
        raise ValueError(f"{where}: {problem}{_mark(err)}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{where} is not valid YAML (truncated or corrupt?): "
                         f"{_describe_yaml_error(err)}") from None
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply to be a plan") from None


def _mark(err) -> str:
    mark = getattr(err, "problem_mark", None)
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def _describe_yaml_error(err) -> str:
    problem = getattr(err, "problem", None)
    if problem:
        return f"{problem}{_mark(err)}"
    return str(err).replace("\n", " ")


# Plan fields (Plan.to_dict) that hold one entry per rank -> the plan file's per-rank key.
_PER_RANK_FIELDS = {"batch_sizes": "local_batch", "hosts": "host", "devices": "device",
                    "max_batch_sizes": "max_batch_size", "min_batch_sizes": "min_batch_size",
                    "predicted_step_s": "predicted_step_s",
                    "curves": "curve"}


def _file_layout(d) -> dict:
    """A :meth:`Plan.to_dict` mapping in the plan file's layout, so one parser checks both."""
    if not isinstance(d, dict):
        raise ValueError(f"a plan must be a mapping; got {_kind(d)}")
    fields = [f.name for f in dataclasses.fields(Plan)]
    _no_unknown_keys(d, fields, "")
    for key in ("batch_sizes", "global_batch_size"):
        if key not in d:
            raise ValueError(f"it has no {key!r}")
    columns = {}
    for field, key in _PER_RANK_FIELDS.items():
        value = d.get(field)
        if value is None or (field != "batch_sizes" and len(value) == 0 and isinstance(value, (list, tuple))):
            continue
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{field} must be a list with one entry per rank; got {_kind(value)}")
        if field == "curves":
            value = [[list(p) if isinstance(p, (list, tuple)) else p for p in c]
                     if isinstance(c, (list, tuple)) else c for c in value]
        columns[key] = list(value)
    world_size = len(columns["local_batch"])
    for key, value in columns.items():
        if len(value) != world_size:
            raise ValueError(f"{key!r} has {len(value)} entries for {world_size} ranks")
    data = {"format_version": FORMAT_VERSION, "world_size": world_size,
            "global_batch_size": d["global_batch_size"],
            "ranks": [{key: value[i] for key, value in columns.items()} for i in range(world_size)]}
    for key in ("method", "benchmark_s"):
        if key in d:
            data[key] = d[key]
    return data


def _from_data(data, path: str = "") -> PlanFile:
    if data is None:
        raise ValueError("it is empty")
    if not isinstance(data, dict):
        raise ValueError(f"it must hold a mapping at the top; got {_kind(data)}")
    _no_unknown_keys(data, _TOP_KEYS, "")
    if "format_version" not in data:
        raise ValueError("it has no 'format_version': not an hvd_balance plan file")
    version = _int(data["format_version"], "format_version", 1)
    if version > FORMAT_VERSION:
        raise ValueError(
            f"format_version {version} was written by a newer hvd_balance; this one reads "
            f"format_version {FORMAT_VERSION}: upgrade hvd_balance")
    for key in ("world_size", "global_batch_size", "ranks"):
        if key not in data:
            raise ValueError(f"it has no {key!r} (truncated file?)")
    world_size = _int(data["world_size"], "world_size", 1)
    global_batch = _int(data["global_batch_size"], "global_batch_size", 1)
    method = data.get("method", "given")
    if not isinstance(method, str) or not method:
        raise ValueError(f"method must be a non-empty string; got {method!r}")
    benchmark_s = _number(data.get("benchmark_s", 0.0), "benchmark_s", minimum=0.0)
    if "predicted_makespan_s" in data:
        _number(data["predicted_makespan_s"], "predicted_makespan_s", minimum=0.0)
    made_with = data.get("made_with") or {}
    if not isinstance(made_with, dict):
        raise ValueError(f"made_with must be a mapping of package to version; got {_kind(made_with)}")
    for k, v in made_with.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ValueError(f"made_with entry {k!r}: {v!r} is not a package name and version")
    created = data.get("created", "")
    if isinstance(created, (datetime.date, datetime.datetime)):
        created = created.isoformat()
    if not isinstance(created, str):
        raise ValueError(f"created must be a date string; got {created!r}")

    ranks = data["ranks"]
    if not isinstance(ranks, list):
        raise ValueError(f"ranks must be a list with one entry per rank; got {_kind(ranks)}")
    if len(ranks) != world_size:
        raise ValueError(
            f"world_size is {world_size} but {len(ranks)} ranks are listed (truncated or edited file?)")
    present = {k: [] for k in _RANK_KEYS}
    batches, hosts, devices, caps, floors, predicted, curves = [], [], [], [], [], [], []
    for i, r in enumerate(ranks):
        at = f"ranks[{i}]"
        if not isinstance(r, dict):
            raise ValueError(f"{at} must be a mapping; got {_kind(r)}")
        _no_unknown_keys(r, _RANK_KEYS, at)
        for k in r:
            present[k].append(i)
        if "rank" in r and (_int(r["rank"], at + ".rank", 0) != i):
            raise ValueError(f"{at} says rank: {r['rank']}; ranks must be listed in order 0..{world_size - 1}")
        if "local_batch" not in r:
            raise ValueError(f"{at} has no 'local_batch'")
        b = _int(r["local_batch"], at + ".local_batch", 0)
        batches.append(b)
        if "weight" in r:
            w = _number(r["weight"], at + ".weight", minimum=0.0)
            want = b / global_batch
            if abs(w - want) > _WEIGHT_RTOL * max(1.0, want):
                raise ValueError(
                    f"{at}.weight is {w!r} but local_batch / global_batch_size is {b}/{global_batch} "
                    f"= {want!r}; the weight follows from the batch: edit local_batch instead")
        if "host" in r:
            hosts.append(_string(r["host"], at + ".host"))
        if "device" in r:
            devices.append(_string(r["device"], at + ".device"))
        if "max_batch_size" in r:
            cap = None if r["max_batch_size"] is None else _int(r["max_batch_size"], at + ".max_batch_size", 1)
            if cap is not None and b > cap:
                raise ValueError(f"{at}.local_batch {b} exceeds its max_batch_size {cap}")
            caps.append(cap)
        else:
            caps.append(None)
        if "min_batch_size" in r:
            floor = None if r["min_batch_size"] is None else _int(r["min_batch_size"], at + ".min_batch_size", 1)
            if floor is not None and 0 < b < floor:  # (a floor above the cap is refused too)
                raise ValueError(f"rank {i}: {at}.local_batch {b} is below its min_batch_size {floor}")
            floors.append(floor)
        else:
            floors.append(None)
        if "predicted_step_s" in r:
            predicted.append(_number(r["predicted_step_s"], at + ".predicted_step_s", minimum=0.0))
        if "curve" in r:
            curves.append(_curve(r["curve"], at + ".curve"))
    for key in ("host", "device", "predicted_step_s", "curve"):
        have = present[key]
        if have and len(have) != world_size:
            missing = sorted(set(range(world_size)) - set(have))
            raise ValueError(f"{key!r} is given for some ranks but not for ranks {_short(missing)}")
    total = sum(batches)
    if total != global_batch:
        raise ValueError(f"the local batches {_short(batches)} add up to {total}, "
                         f"not global_batch_size {global_batch}")
    plan = Plan(
        batch_sizes=tuple(batches), global_batch_size=global_batch, method=method,
        curves=tuple(curves), max_batch_sizes=tuple(caps) if present["max_batch_size"] else None,
        min_batch_sizes=tuple(floors) if present["min_batch_size"] else None,
        predicted_step_s=tuple(predicted), hosts=tuple(hosts), devices=tuple(devices),
        benchmark_s=benchmark_s)
    return PlanFile(plan=plan, format_version=version,
                    made_with={str(k): str(v) for k, v in made_with.items()}, created=created, path=path)


def _kind(value) -> str:
    return "nothing (null)" if value is None else f"{type(value).__name__} {_clip(value)}"


def _clip(value, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _short(items, n: int = 8) -> str:
    items = list(items)
    text = ", ".join(str(x) for x in items[:n])
    return f"[{text}{', ...' if len(items) > n else ''}]"


def _no_unknown_keys(mapping: dict, allowed, where: str):
    unknown = [k for k in mapping if k not in allowed]
    if unknown:
        raise ValueError(f"unknown key {_clip(unknown[0])}{' in ' + where if where else ''}; "
                         f"known keys: {', '.join(allowed)}")


def _int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be an integer >= {minimum}; got {_clip(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value}")
    return value


def _number(value, name: str, minimum: Optional[float] = None, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number; got {_clip(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0; got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def _string(value, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string; got {_clip(value)}")
    return value


def _curve(value, name: str):
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of [local_batch, seconds] pairs; "
                         f"got {_clip(value)}")
    points = []
    for j, p in enumerate(value):
        if not isinstance(p, list) or len(p) != 2:
            raise ValueError(f"{name}[{j}] must be a [local_batch, seconds] pair; got {_clip(p)}")
        points.append((_int(p[0], f"{name}[{j}] local_batch", 1),
                       _number(p[1], f"{name}[{j}] seconds", positive=True)))
    return tuple(points)

"""The Plan: each rank's local batch and gradient weight, and what they were made from."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

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

    def __post_init__(self):
        sizes = tuple(self.batch_sizes)
        for i, b in enumerate(sizes):
            if isinstance(b, bool) or not float(b).is_integer() or b < 1:
                raise ValueError(f"plan batch_sizes[{i}] must be an integer >= 1; got {b!r}")
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

    @property
    def world_size(self) -> int:
        return len(self.batch_sizes)

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
        :mod:`hvd_balance.plan_file`. Call it on rank 0 only.

        Example:
            >>> plan.save("plan.yaml")  # doctest: +SKIP
            >>> Plan.load("plan.yaml", world_size=4, global_batch_size=256)  # doctest: +SKIP
        """
        from . import plan_file

        return plan_file.save(self, path)

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
        from . import plan_file

        plan = plan_file.load(path)
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
        for k in ("predicted_step_s", "hosts", "devices"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on missing or wrong fields."""
        if not isinstance(d, dict):
            raise ValueError(f"a plan must be a mapping; got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown plan fields: {sorted(unknown)}")
        for key in ("batch_sizes", "global_batch_size"):
            if key not in d:
                raise ValueError(f"the plan has no {key!r}")
        kw = dict(d)
        try:
            kw["batch_sizes"] = tuple(kw["batch_sizes"])
            kw["curves"] = tuple(tuple((int(b), float(t)) for b, t in c) for c in kw.get("curves") or ())
            if kw.get("max_batch_sizes") is not None:
                kw["max_batch_sizes"] = tuple(kw["max_batch_sizes"])
            for k in ("predicted_step_s", "hosts", "devices"):
                kw[k] = tuple(kw.get(k) or ())
        except (TypeError, ValueError) as err:
            raise ValueError(f"malformed plan: {err}") from None
        if isinstance(kw["global_batch_size"], bool) or not isinstance(kw["global_batch_size"], int):
            raise ValueError(f"global_batch_size must be an integer; got {kw['global_batch_size']!r}")
        return cls(**kw)

    def table(self, samples_per_s: Optional[Sequence[float]] = None) -> str:
        """A readable table: rank, host, device, samples/s, local batch, weight, predicted step.

        A ``max batch`` column is added when the plan has caps.
        """
        capped = self.max_batch_sizes is not None
        rows = [("rank", "host", "device", "samples/s", "local batch", "weight", "pred. step ms")
                + (("max batch",) if capped else ())]
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

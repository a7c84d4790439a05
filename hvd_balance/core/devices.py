"""Device specs: which device each local rank trains on, as pure data (no TensorFlow).

A *device spec* lists, for one host, the device of each local rank in local-rank order::

    "gpu,gpu,gpu,cpu"     ranks 0-2 on GPUs 0-2, rank 3 on the CPU
    "gpu*3,cpu"           the same, shorter
    "gpu:2,gpu:0,cpu"     explicit GPU indices (as TensorFlow lists the visible GPUs)
    "auto"                one rank per visible GPU, the remaining ranks on the CPU

A spec can differ from host to host: ``"node1=gpu*4,cpu;node2=cpu*2;*=auto"`` (``*``
matches any other host). The spec comes from the ``spec`` argument, else the
``HVD_BALANCE_DEVICES`` environment variable, else ``HVD_BALANCE_DEVICES_FILE`` (a hostfile,
see :func:`read_hostfile`), else ``"auto"``. The host is found by the name the launcher gave
it (``HOROVOD_HOSTNAME``, set by horovodrun) or this machine's host name.

CPU threads. Left to itself every TensorFlow process uses all of the host's cores, so CPU
ranks sharing a host slow each other down and the GPU ranks' feeders. When a host runs any
CPU rank, each GPU rank there is given ``cores_per_gpu_rank`` (2) threads and the cores left
over are divided evenly among the CPU ranks (at least one each); a host with GPU ranks only
keeps TensorFlow's defaults. Inter-op threads are 1, or 2 for a rank with 4 or more threads.

The mapping itself is pure (:func:`assign_devices`: numbers in, assignments out) and is
tested with injected GPU lists; :func:`hvd_balance.keras.pinning.pin_devices` applies it to
``tf.config``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

ENV_SPEC = "HVD_BALANCE_DEVICES"
ENV_FILE = "HVD_BALANCE_DEVICES_FILE"
KINDS = ("gpu", "cpu")

_ENTRY = re.compile(r"^(gpu|cpu)(?::(\d+))?(?:\*(\d+))?$")

# (local rank, local size) environment variables, in the order they are trusted.
_LOCAL_ENV = (
    ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),                   # horovodrun (Gloo)
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),   # Open MPI
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),                         # MPICH, Intel MPI
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),     # MVAPICH2
)



@dataclasses.dataclass(frozen=True)
class DeviceAssignment:
    """The device of one local rank.

    Attributes:
        local_rank: the rank's index on its host.
        kind: ``"gpu"`` or ``"cpu"``.
        gpu_index: index into the host's visible GPUs (``None`` for a CPU rank).
        gpu_name: the GPU's model name, when known (``""`` otherwise).
        intra_op_threads, inter_op_threads: TensorFlow thread pools (``None``: TensorFlow's
            default).
    """

    local_rank: int
    kind: str
    gpu_index: Optional[int] = None
    gpu_name: str = ""
    intra_op_threads: Optional[int] = None
    inter_op_threads: Optional[int] = None

    @property
    def label(self) -> str:
        """What the plan table shows: ``"gpu:0 (NVIDIA A100)"``, ``"cpu (4 threads)"``."""
        if self.kind == "gpu":
            return f"gpu:{self.gpu_index}" + (f" ({self.gpu_name})" if self.gpu_name else "")
        if self.intra_op_threads:
            return f"cpu ({self.intra_op_threads} thread{'s' if self.intra_op_threads != 1 else ''})"
        return "cpu"

    def __str__(self):
        return self.label


@dataclasses.dataclass(frozen=True)
class HostEntry:
    """One line of a hostfile: ``node1 slots=4 devices=gpu*3,cpu``.

    Attributes:
        host: the host name, as the launcher will be given it.
        slots: ranks to run there.
        devices: the host's device spec (``"auto"`` when the line has none).
        line: the line number in the file (1-based).
    """

    host: str
    slots: int
    devices: str = "auto"
    line: int = 0


def parse_spec(spec: str, source: str = "device spec") -> List[Tuple[str, Optional[int]]]:
    """Expand a one-host spec into ``[(kind, gpu_index or None), ...]``; ``[]`` for ``"auto"``.

    Raises:
        ValueError: naming the bad entry, e.g. ``HVD_BALANCE_DEVICES entry 3 'tpu' is not a device``.
    """
    if not isinstance(spec, str):
        raise ValueError(f"{source} must be a string like 'gpu,gpu,cpu' or 'auto'; got {spec!r}")
    text = spec.strip().lower()
    if text == "auto":
        return []
    if not text:
        raise ValueError(f"{source} is empty: give one device per local rank, e.g. 'gpu,gpu,cpu', or 'auto'")
    out: List[Tuple[str, Optional[int]]] = []
    for pos, raw in enumerate(text.split(","), start=1):
        entry = raw.strip().replace(" ", "")
        if entry == "auto":
            raise ValueError(f"{source}: 'auto' stands alone; it cannot be mixed with other entries "
                             f"(entry {pos} of {spec!r})")
        m = _ENTRY.match(entry)
        if not m:
            raise ValueError(
                f"{source} entry {pos} {raw.strip()!r} is not a device: use 'gpu', 'gpu:<index>' or "
                f"'cpu', each optionally repeated as '*<count>' (in {spec!r}), or 'auto'")
        kind, index, count = m.group(1), m.group(2), m.group(3)
        if kind == "cpu" and index is not None:
            raise ValueError(f"{source} entry {pos} {raw.strip()!r}: a CPU rank takes no index (in {spec!r})")
        n = 1 if count is None else int(count)
        if n < 1:
            raise ValueError(f"{source} entry {pos} {raw.strip()!r}: the count must be >= 1 (in {spec!r})")
        if index is not None and n > 1:
            raise ValueError(f"{source} entry {pos} {raw.strip()!r}: one GPU index cannot be repeated "
                             f"(in {spec!r})")
        out.extend([(kind, None if index is None else int(index))] * n)
    return out


def count_ranks(spec: str, source: str = "device spec") -> Optional[int]:
    """Ranks a spec describes (``None`` for ``"auto"``, which fits any number)."""
    entries = parse_spec(spec, source)
    return len(entries) if entries else None


def assign_devices(spec: str, local_size: int, n_gpus: int, cpu_count: int,
                   gpu_names: Optional[Sequence[str]] = None, cores_per_gpu_rank: int = 2,
                   source: str = "device spec") -> Tuple[DeviceAssignment, ...]:
    """The device of every local rank on one host (pure: no TensorFlow).

    Args:
        spec: the host's device spec (see the module docstring).
        local_size: ranks on this host.
        n_gpus: GPUs visible to the ranks of this host.
        cpu_count: cores available on this host.
        gpu_names: optional model name of each visible GPU, for the labels.
        cores_per_gpu_rank: threads kept for each GPU rank when the host also runs CPU ranks.
        source: how to name the spec in error messages.

    Returns:
        One :class:`DeviceAssignment` per local rank, in local-rank order.

    Raises:
        ValueError: a bad entry, a spec whose length is not ``local_size``, a GPU index
            that is not visible, or one GPU given to two ranks.

    Example:
        >>> [a.label for a in assign_devices("auto", 3, n_gpus=1, cpu_count=8)]
        ['gpu:0', 'cpu (3 threads)', 'cpu (3 threads)']
    """
    for name, value, low in (("local_size", local_size, 1), ("n_gpus", n_gpus, 0), ("cpu_count", cpu_count, 1),
                             ("cores_per_gpu_rank", cores_per_gpu_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    entries = parse_spec(spec, source)
    if not entries:  # auto
        entries = [("gpu", None) if r < n_gpus else ("cpu", None) for r in range(local_size)]
    elif len(entries) != local_size:
        raise ValueError(
            f"{source} {spec!r} names {len(entries)} device{'s' if len(entries) != 1 else ''} but this "
            f"host runs {local_size} rank{'s' if local_size != 1 else ''} (local size {local_size}): "
            f"give one device per local rank, or 'auto'")
    explicit = {}
    for r, (kind, index) in enumerate(entries):
        if kind == "gpu" and index is not None:
            if index in explicit:
                raise ValueError(f"{source} {spec!r} gives gpu:{index} to local ranks {explicit[index]} and {r}")
            explicit[index] = r
    free = (i for i in range(max(n_gpus, len(entries) + len(explicit) + 1)) if i not in explicit)
    gpu_of: Dict[int, int] = {}
    for r, (kind, index) in enumerate(entries):
        if kind == "gpu":
            gpu_of[r] = index if index is not None else next(free)
    for r, index in gpu_of.items():
        if index >= n_gpus:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise ValueError(
                f"{source} {spec!r} puts local rank {r} on gpu:{index} but {n_gpus} GPU"
                f"{'s are' if n_gpus != 1 else ' is'} visible{hint}; when the launcher gives each "
                f"rank its own GPU use 'gpu:0', or use 'auto'")
    n_cpu = sum(1 for kind, _ in entries if kind == "cpu")
    n_gpu = len(entries) - n_cpu
    threads: Dict[int, int] = {}
    if n_cpu:
        left = cpu_count - cores_per_gpu_rank * n_gpu
        base, extra = divmod(max(left, 0), n_cpu)
        j = 0
        for r, (kind, _) in enumerate(entries):
            if kind == "cpu":
                threads[r] = max(1, base + (j < extra))
                j += 1
            elif cores_per_gpu_rank:
                threads[r] = cores_per_gpu_rank
    names = list(gpu_names or [])
    out = []
    for r, (kind, _) in enumerate(entries):
        n = threads.get(r)
        inter = None if n is None else (2 if n >= 4 else 1)
        if kind == "gpu":
            index = gpu_of[r]
            name = str(names[index]) if index < len(names) and names[index] else ""
            out.append(DeviceAssignment(r, "gpu", index, name, n, inter))
        else:
            out.append(DeviceAssignment(r, "cpu", None, "", n, inter))
    return tuple(out)


def parse_host_specs(text: str, source: str = ENV_SPEC) -> Dict[str, str]:
    """``"node1=gpu,cpu;node2=auto;*=cpu"`` -> ``{"node1": "gpu,cpu", ...}`` (each spec checked)."""
    out: Dict[str, str] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        host, eq, spec = part.partition("=")
        host, spec = host.strip(), spec.strip()
        if not eq or not host:
            raise ValueError(f"{source}: {part!r} is not 'host=spec' (in {text!r})")
        if host in out:
            raise ValueError(f"{source} names host {host!r} twice (in {text!r})")
        parse_spec(spec, f"{source} for host {host!r}")
        out[host] = spec
    if not out:
        raise ValueError(f"{source} is empty: give a spec like 'gpu,gpu,cpu' or 'auto'")
    return out


def read_hostfile(path: str) -> List[HostEntry]:
    """Parse a hostfile of lines ``host [slots=N] [devices=SPEC]``.

    ``#`` starts a comment; blank lines are skipped. ``slots`` defaults to the number of
    devices, or 1 with ``devices=auto`` (the default). When both are given they must agree.

    Example::

        # host   ranks    the device of each local rank
        node1    slots=4  devices=gpu,gpu,gpu,cpu
        node2    slots=2  devices=cpu,cpu
        node3    slots=5  devices=auto

    Raises:
        ValueError: naming the file and line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read hostfile {path!r}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ValueError(f"hostfile {path!r} is not UTF-8 text") from None
    entries: List[HostEntry] = []
    seen: Dict[str, int] = {}
    for no, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"hostfile {path!r} line {no}"
        fields = text.split()
        host, opts = fields[0], {}
        if "=" in host or ":" in host:
            raise ValueError(f"{where}: {host!r} is not a host name (write 'host slots=N devices=SPEC')")
        for field in fields[1:]:
            key, eq, value = field.partition("=")
            if not eq or key not in ("slots", "devices") or not value:
                raise ValueError(f"{where}: unknown field {field!r}; use slots=N and devices=SPEC")
            if key in opts:
                raise ValueError(f"{where}: {key}= is given twice")
            opts[key] = value
        if host in seen:
            raise ValueError(f"{where}: host {host!r} is already on line {seen[host]}")
        seen[host] = no
        spec = opts.get("devices", "auto")
        n_dev = count_ranks(spec, f"{where} devices=")
        if "slots" in opts:
            if not opts["slots"].isdigit() or int(opts["slots"]) < 1:
                raise ValueError(f"{where}: slots must be an integer >= 1; got {opts['slots']!r}")
            slots = int(opts["slots"])
            if n_dev is not None and n_dev != slots:
                raise ValueError(f"{where}: {host} has slots={slots} but devices={spec} names {n_dev} "
                                 f"device{'s' if n_dev != 1 else ''}")
        else:
            slots = n_dev or 1
        entries.append(HostEntry(host, slots, spec, no))
    if not entries:
        raise ValueError(f"hostfile {path!r} names no host")
    return entries


def host_names(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Names this host may go by, most specific first: the launcher's, then the system's."""
    env = os.environ if env is None else env
    names = []
    for name in (env.get("HOROVOD_HOSTNAME"), socket.gethostname()):
        if name and name not in names:
            names.append(name)
    for name in list(names):
        short = name.split(".")[0]
        if short and short not in names and not short.isdigit():
            names.append(short)
    return names


def host_name(env: Optional[Mapping[str, str]] = None) -> str:
    """This host's name as the launcher knows it (``HOROVOD_HOSTNAME``), else the system's.

    Use it for the hosts recorded in a plan: it is the name given to ``horovodrun -H``, so
    a plan's hosts compare equal to the launcher's host list on the next run.
    """
    return host_names(env)[0]


def _pick_host_spec(specs: Mapping[str, str], names: Sequence[str], source: str) -> str:
    for name in names:
        if name in specs:
            return specs[name]
    if "*" in specs:
        return specs["*"]
    for name in names:  # a long name in the mapping for this host's short name
        for host, spec in specs.items():
            if host.split(".")[0] == name:
                return spec
    raise ValueError(f"{source} has no entry for this host (known here as "
                     f"{', '.join(repr(n) for n in names)}); it names {', '.join(repr(h) for h in specs)}. "
                     f"Add this host or a '*=...' default")


def resolve_spec(spec: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                 names: Optional[Sequence[str]] = None) -> Tuple[str, str]:
    """The one-host spec to use and where it came from: ``(spec, source)``.

    Order: ``spec`` argument, ``HVD_BALANCE_DEVICES``, ``HVD_BALANCE_DEVICES_FILE``, ``"auto"``.
    A spec with ``host=...`` parts is looked up by this host's name (:func:`host_names`).
    """
    env = os.environ if env is None else env
    if spec is not None:
        text, source = spec, "device spec"
    elif env.get(ENV_SPEC, "").strip():
        text, source = env[ENV_SPEC], ENV_SPEC
    elif env.get(ENV_FILE, "").strip():
        path = env[ENV_FILE]
        entries = read_hostfile(path)
        specs = {e.host: e.devices for e in entries}
        names = host_names(env) if names is None else list(names)
        return _pick_host_spec(specs, names, f"hostfile {path!r} ({ENV_FILE})"), f"hostfile {path!r}"
    else:
        return "auto", "default"
    if "=" in text:
        specs = parse_host_specs(text, source)
        names = host_names(env) if names is None else list(names)
        return _pick_host_spec(specs, names, source), source
    return text, source


def _slurm_local_size(env: Mapping[str, str]) -> Optional[int]:
    """Tasks on this node from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1")."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not text or node is None or not node.isdigit():
        return None
    counts: List[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    index = int(node)
    return counts[index] if index < len(counts) else None


def local_rank_and_size(env: Optional[Mapping[str, str]] = None) -> Tuple[int, int]:
    """This process's ``(local_rank, local_size)``, from the launcher or an initialised Horovod.

    Reads horovodrun's ``HOROVOD_LOCAL_RANK``/``HOROVOD_LOCAL_SIZE``, then Open MPI, MPICH,
    MVAPICH2 and SLURM (``SLURM_LOCALID`` with the step's tasks per node), then
    ``hvd.local_rank()`` if Horovod is already initialised; ``(0, 1)`` for a lone process.
    """
    env = os.environ if env is None else env
    for rank_var, size_var in _LOCAL_ENV:
        if rank_var in env and size_var in env:
            return _rank_size(env[rank_var], env[size_var], f"{rank_var}/{size_var}")
    if "SLURM_LOCALID" in env:
        size = _slurm_local_size(env)
        if size is not None:
            return _rank_size(env["SLURM_LOCALID"], str(size), "SLURM_LOCALID/SLURM_STEP_TASKS_PER_NODE")
    for module in ("horovod.tensorflow", "horovod.tensorflow.keras"):
        hvd = sys.modules.get(module)
        if hvd is not None:
            try:
                if hvd.is_initialized():
                    return int(hvd.local_rank()), int(hvd.local_size())
            except (AttributeError, ValueError):
                pass
    return 0, 1


def _rank_size(rank: str, size: str, source: str) -> Tuple[int, int]:
    try:
        r, n = int(rank), int(size)
    except ValueError:
        raise ValueError(f"{source} must be integers; got {rank!r}/{size!r}") from None
    if not 0 <= r < n:
        raise ValueError(f"{source}: local rank {r} is not within local size {n}")
    return r, n


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1

"""The ``hvd-balance`` command.

Subcommands (each has ``--help``)::

    hvd-balance plan --rates 300,100 --global-batch 64 -o plan.yaml
    hvd-balance plan --curves curves.yaml --global-batch 256 --max-batch gpu=512,cpu=64
    hvd-balance plan --rates 500,10 -B 128 --min-batch-size 16   # a floor (batch norm)
    hvd-balance show plan.yaml [--world-size 4 --global-batch 256 --hosts a,a,b,b]
    hvd-balance devices gpu,gpu,cpu --gpus 2 --cpus 16
    hvd-balance launch hosts.txt [--dry-run] [horovodrun options] -- python train.py
    hvd-balance run --cpu-shares 1.0,0.25 -- python train.py   (hvd_balance.emulate)
    hvd-balance run --slowdown 1,4 -- python train.py          (slow compute, full-speed collectives)
    hvd-balance simulate ...                                   (hvd_balance.simulate)
    hvd-balance bench ...                                      (hvd_balance.bench)

Exit status: 0 on success, 1 when the command fails (a bad file, a plan that does not fit
the job, a missing module), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import shutil
import sys
from typing import List, Optional, Sequence

PROG = "hvd-balance"

# Subcommands that live in other modules: name -> (module, one-line description).
DELEGATED = {
    "run": ("hvd_balance.tools.emulate",
            "emulate a heterogeneous cluster on one machine: --cpu-shares 1.0,0.25 (CPU quotas) "
            "or --slowdown 1,4 (slow compute) -- python train.py"),
    "simulate": ("hvd_balance.tools.simulate", "simulate balancing for many ranks without training"),
    "bench": ("hvd_balance.tools.bench", "benchmark the balancing methods on emulated clusters"),
    "report": ("hvd_balance.tools.report", "summarize and draw a run's record (HVD_BALANCE_HISTORY)"),
}


class CommandError(Exception):
    """A failure to report as ``hvd-balance <cmd>: <message>`` with exit status 1."""


def _split_list(text: str, what: str) -> List[str]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise CommandError(f"{what} must be a comma-separated list with no empty entries; got {text!r}")
    return items


def _parse_rates(text: str) -> List[float]:
    rates = []
    for i, item in enumerate(_split_list(text, "--rates")):
        try:
            rates.append(float(item))
        except ValueError:
            raise CommandError(f"--rates entry {i} {item!r} is not a number of samples/s") from None
    return rates


def _parse_max_batch(text: str):
    """``"64"`` -> 64; ``"64,none,32"`` -> list; ``"gpu=512,cpu=64"`` -> dict."""
    items = _split_list(text, "--max-batch")
    if any("=" in i for i in items):
        table = {}
        for item in items:
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise CommandError(f"--max-batch entry {item!r} is not 'device=cap'")
            table[key.strip()] = _cap_value(value, item)
        return table
    caps = [_cap_value(i, i) for i in items]
    return caps[0] if len(caps) == 1 else caps


def _parse_min_batch(text: str):
    """``"16"`` -> 16 (every rank); ``"none,16"`` -> one floor per rank (``none``: 1)."""
    floors = []
    for item in _split_list(text, "--min-batch-size"):
        value = item.strip().lower()
        if value in ("none", "-"):
            floors.append(None)
        elif value.isdigit():
            floors.append(int(value))
        else:
            raise CommandError(f"--min-batch-size entry {item!r}: a floor is an integer number of "
                               f"samples or 'none'")
    return floors[0] if len(floors) == 1 else floors


def _cap_value(value: str, item: str):
    value = value.strip().lower()
    if value in ("none", "-", ""):
        return None
    if not value.isdigit():
        raise CommandError(f"--max-batch entry {item!r}: a cap is an integer number of samples or 'none'")
    return int(value)


def _read_curves(path: str):
    """Curves (and hosts/devices/caps when known) from a plan file or a curves file."""
    from ..core import plan as plan_file

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise CommandError(f"cannot read {path!r}: {err.strerror or err}") from None
    data = plan_file.load_yaml(raw, source=path, what="curves file")
    info = {}
    if isinstance(data, dict) and "format_version" in data:
        plan = plan_file.parse(raw, source=path).plan
        if not plan.curves:
            raise CommandError(f"plan file {path!r} holds no measured curves to plan from")
        info = {"hosts": list(plan.hosts), "devices": list(plan.devices),
                "max_batch_sizes": plan.max_batch_sizes, "global_batch_size": plan.global_batch_size,
                "min_batch_sizes": plan.min_batch_sizes}
        return [list(c) for c in plan.curves], info
    if isinstance(data, dict):
        unknown = set(data) - {"curves", "rates", "hosts", "devices"}
        if unknown:
            raise CommandError(f"{path!r}: unknown key {sorted(unknown)[0]!r}; "
                               f"use curves (or rates), hosts and devices")
        if ("curves" in data) == ("rates" in data):
            raise CommandError(f"{path!r} must have exactly one of 'curves' and 'rates'")
        entries = data.get("curves", data.get("rates"))
        for key in ("hosts", "devices"):
            if key in data:
                if not isinstance(data[key], list) or not all(isinstance(h, str) for h in data[key]):
                    raise CommandError(f"{path!r}: {key} must be a list of strings")
                info[key] = data[key]
    else:
        entries = data
    if not isinstance(entries, list) or not entries:
        raise CommandError(f"{path!r} must hold one entry per rank: a throughput in samples/s "
                           f"or a curve [[local_batch, seconds], ...]")
    return entries, info


def cmd_plan(args) -> int:
    from ..core.memory_caps import resolve_max_batch_sizes
    from ..core.planner import plan_batches

    if (args.rates is None) == (args.curves is None):
        raise CommandError("give exactly one of --rates and --curves")
    info = {}
    if args.rates is not None:
        entries = _parse_rates(args.rates)
    else:
        entries, info = _read_curves(args.curves)
    hosts = _split_list(args.hosts, "--hosts") if args.hosts else info.get("hosts") or []
    devices = _split_list(args.devices, "--devices") if args.devices else info.get("devices") or []
    n = len(entries)
    for name, values in (("--hosts", hosts), ("--devices", devices)):
        if values and len(values) != n:
            raise CommandError(f"{name} has {len(values)} entries for {n} ranks")
    global_batch = args.global_batch if args.global_batch is not None else info.get("global_batch_size")
    if global_batch is None:
        raise CommandError("--global-batch is required")
    if args.max_batch is not None:
        caps = resolve_max_batch_sizes(_parse_max_batch(args.max_batch), devices=devices or None,
                                       world_size=n, global_batch_size=global_batch)
    else:
        caps = info.get("max_batch_sizes")
    floors = (_parse_min_batch(args.min_batch_size) if args.min_batch_size is not None
              else info.get("min_batch_sizes"))
    plan = plan_batches(entries, global_batch, max_batch_sizes=caps, method=args.method,
                        min_batch_sizes=floors, hosts=tuple(hosts), devices=tuple(devices))
    print(plan.table())
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_show(args) -> int:
    from ..core import plan as plan_file

    pf = plan_file.read(args.plan)
    if args.yaml:
        sys.stdout.write(plan_file.to_yaml(pf.plan, made_with=pf.made_with, created=pf.created))
        return 0
    made = ", ".join(f"{k} {v}" for k, v in pf.made_with.items()) or "unknown versions"
    print(f"plan file {args.plan} (format {pf.format_version}"
          f"{', created ' + pf.created if pf.created else ''}; made with {made})")
    print(pf.plan.table())
    hosts = _split_list(args.hosts, "--hosts") if args.hosts else None
    if args.world_size is None and (args.global_batch is not None or hosts is not None):
        raise CommandError("--global-batch and --hosts are checked together with --world-size")
    if args.world_size is not None:
        problems = pf.plan.mismatches(args.world_size, args.global_batch, hosts)
        if problems:
            raise CommandError(f"plan file {args.plan!r} does not fit this job: " + "; ".join(problems))
        print(f"fits the job: {args.world_size} ranks"
              + (f", global batch {args.global_batch}" if args.global_batch is not None else "")
              + (", same hosts in the same order" if hosts is not None and pf.plan.hosts else ""))
    return 0


def cmd_devices(args) -> int:
    from ..core.devices import assign_devices, resolve_spec

    spec, source = resolve_spec(args.spec)
    names = _split_list(args.gpu_names, "--gpu-names") if args.gpu_names else None
    if args.gpus is not None and names is not None and len(names) != args.gpus:
        raise CommandError(f"--gpu-names has {len(names)} names for --gpus {args.gpus}")
    n_gpus = args.gpus if args.gpus is not None else (len(names) if names is not None else None)
    if n_gpus is None:
        import tensorflow as tf  # only to count the GPUs this machine has

        found = tf.config.list_physical_devices("GPU")
        n_gpus = len(found)
        names = [str(tf.config.experimental.get_device_details(g).get("device_name", "")) for g in found]
    from ..core.devices import _cpu_count, count_ranks, local_rank_and_size

    local_size = args.local_size
    if local_size is None:  # the spec's length, else what the launcher says, else 1
        local_size = count_ranks(spec, source) or local_rank_and_size()[1]
    cpus = args.cpus if args.cpus is not None else _cpu_count()
    out = assign_devices(spec, local_size, n_gpus, cpus, gpu_names=names,
                         cores_per_gpu_rank=args.cores_per_gpu_rank, source=source)
    print(f"devices {spec!r} ({source}) for {local_size} local ranks, {n_gpus} GPUs, {cpus} cores:")
    rows = [("local rank", "device", "intra-op", "inter-op")]
    for a in out:
        rows.append((str(a.local_rank), a.label, str(a.intra_op_threads or "default"),
                     str(a.inter_op_threads or "default")))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for r in rows:
        print("  ".join(v.ljust(w) if c == 1 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths))).rstrip())
    return 0


def build_launch(hostfile: str, command: Sequence[str], launcher: str = "horovodrun",
                 launcher_args: Sequence[str] = ()):
    """The horovodrun command and environment for a hostfile with per-host devices.

    Returns ``(argv, env_updates)``: ``horovodrun -np N -H host1:s1,host2:s2 [launcher_args]
    command...`` and ``{"HVD_BALANCE_DEVICES": "host1=spec1;host2=spec2"}``, which horovodrun
    passes to every rank; :func:`hvd_balance.pin_devices` picks its host's spec by name.
    Ranks are numbered host by host in hostfile order.
    """
    from ..core.devices import ENV_SPEC, read_hostfile

    for flag in ("-np", "-n", "--num-proc", "-H", "--hosts", "-hostfile", "--hostfile"):
        if flag in launcher_args:
            raise CommandError(f"{flag} comes from the hostfile; do not pass it to the launcher")
    if not command:
        raise CommandError("give the training command after '--', e.g. -- python train.py")
    entries = read_hostfile(hostfile)
    total = sum(e.slots for e in entries)
    hosts = ",".join(f"{e.host}:{e.slots}" for e in entries)
    mapping = ";".join(f"{e.host}={e.devices.replace(' ', '')}" for e in entries)
    argv = [launcher, "-np", str(total), "-H", hosts, *launcher_args, *command]
    return argv, {ENV_SPEC: mapping}


def cmd_launch(args, extra: Sequence[str], command: Sequence[str]) -> int:
    argv, env_updates = build_launch(args.hostfile, command, args.launcher, extra)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env_updates.items()) + " " + shlex.join(argv)
    if args.dry_run:
        print(shown)
        return 0
    path = shutil.which(argv[0])
    if path is None:
        raise CommandError(f"{argv[0]!r} is not on PATH: activate the environment with Horovod, "
                           f"or pass --launcher /path/to/horovodrun")
    print(shown, file=sys.stderr, flush=True)
    env = dict(os.environ, **env_updates)
    os.execve(path, argv, env)
    return 0  # pragma: no cover - execve does not return


def _delegate(name: str, argv: Sequence[str]) -> int:
    module_name, description = DELEGATED[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise  # the module exists but something it needs is missing: show the real error
        module = None
    if module is None or not callable(getattr(module, "main", None)):
        if any(a in ("-h", "--help") for a in argv):
            print(f"usage: {PROG} {name} ...\n\n{description}\n\n"
                  f"({module_name} is not part of this installation of hvd_balance yet.)")
            return 0
        print(f"{PROG} {name}: {module_name} is not available in this installation of hvd_balance "
              f"(it provides '{PROG} {name}': {description})", file=sys.stderr)
        return 1
    result = module.main(list(argv))
    return 0 if result is None else int(result)


def _parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Load balancing for synchronous Horovod Keras training on "
                               "heterogeneous clusters: plans, plan files, devices and launchers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("plan", help="plan local batches from throughputs or measured curves",
                       description="Plan each rank's local batch so all ranks finish a step together; "
                                   "print the plan and optionally write it as a plan file.")
    p.add_argument("--rates", metavar="R0,R1,...", help="each rank's throughput in samples/s")
    p.add_argument("--curves", metavar="FILE",
                   help="YAML or JSON: a list with one entry per rank (a throughput, or a curve "
                        "[[local_batch, seconds], ...]), or a mapping with curves/rates, hosts and "
                        "devices, or a plan file (re-plans its measured curves)")
    p.add_argument("-B", "--global-batch", type=int, metavar="B",
                   help="samples per step over all ranks (default: the plan file's)")
    p.add_argument("--method", choices=("minmax", "proportional"), default="minmax",
                   help="minmax: minimise the slowest rank's step (default); proportional: the "
                        "paper's rule")
    p.add_argument("--max-batch", metavar="CAPS",
                   help="memory caps: one number, one per rank ('64,none,32'), or by device "
                        "('gpu=512,cpu=64', 'T4=128')")
    p.add_argument("--min-batch-size", "--min-batch", metavar="FLOORS",
                   help="floor on each local batch in samples, e.g. 16 for batch normalization: "
                        "one number, or one per rank ('none,16')")
    p.add_argument("--hosts", metavar="H0,H1,...", help="each rank's host, stored in the plan")
    p.add_argument("--devices", metavar="D0,D1,...", help="each rank's device, stored in the plan")
    p.add_argument("-o", "--output", metavar="PLAN.yaml", help="write the plan file here")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("show", help="print a plan file as a table, and check it against a job",
                       description="Print a plan file as a readable table. With --world-size (and "
                                   "--global-batch, --hosts), check that it fits that job: exit status "
                                   "1 and a message naming every difference when it does not.")
    p.add_argument("plan", metavar="PLAN.yaml")
    p.add_argument("--world-size", type=int, metavar="N", help="the job's number of ranks")
    p.add_argument("-B", "--global-batch", type=int, metavar="B", help="the job's global batch")
    p.add_argument("--hosts", metavar="H0,H1,...", help="the job's host of each rank, in rank order")
    p.add_argument("--yaml", action="store_true", help="print the validated plan file instead")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("devices", help="show which device each local rank of a host would get",
                       description="Show the device and thread counts pin_devices() gives each local "
                                   "rank of one host, without starting training.")
    p.add_argument("spec", nargs="?", default=None,
                   help="device spec, e.g. 'gpu,gpu,cpu', 'gpu*4,cpu' or 'auto' (default: "
                        "HVD_BALANCE_DEVICES, HVD_BALANCE_DEVICES_FILE, then auto)")
    p.add_argument("--local-size", type=int, metavar="N", help="ranks on this host (default: the spec's length; for auto, from the launcher, else 1)")
    p.add_argument("--gpus", type=int, metavar="N", help="visible GPUs (default: ask TensorFlow)")
    p.add_argument("--gpu-names", metavar="NAME,...", help="model name of each GPU, for the labels")
    p.add_argument("--cpus", type=int, metavar="N", help="cores on the host (default: this machine's)")
    p.add_argument("--cores-per-gpu-rank", type=int, default=2, metavar="N",
                   help="threads kept for each GPU rank on a host with CPU ranks (default 2)")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("launch", help="run horovodrun from a hostfile with per-host devices",
                       description=_LAUNCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage=f"{prog} launch HOSTFILE [--dry-run] [--launcher PATH] [horovodrun options] "
                             f"-- COMMAND ...")
    _launch_arguments(p)

    for name, (module, description) in DELEGATED.items():
        sub.add_parser(name, help=description, add_help=False)
    return parser


_LAUNCH_DESCRIPTION = """\
Start horovodrun on the hosts of HOSTFILE, giving each host its own device spec.

HOSTFILE has one line per host:

    node1  slots=4  devices=gpu,gpu,gpu,cpu
    node2  slots=2  devices=cpu,cpu
    node3  slots=5  devices=auto

This runs `horovodrun -np 11 -H node1:4,node2:2,node3:5 [horovodrun options] COMMAND` with
HVD_BALANCE_DEVICES='node1=gpu,gpu,gpu,cpu;node2=cpu,cpu;node3=auto', which horovodrun passes
to every rank and hvd_balance.pin_devices() reads for its host. Ranks are numbered host by
host in hostfile order, so a plan file stays valid while the hostfile does not change.
Options that are not listed here (--gloo, --mpi, -p PORT, --network-interface ...) go to
horovodrun unchanged."""


def _launch_arguments(p: argparse.ArgumentParser):
    p.add_argument("hostfile", metavar="HOSTFILE", help="lines 'host slots=N devices=SPEC'")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("--launcher", default="horovodrun", metavar="PATH",
                   help="the horovodrun to run (default: horovodrun on PATH)")
    p.set_defaults(func=None)


def _split_command(argv: Sequence[str]):
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def launch_main(argv: Optional[Sequence[str]] = None, prog: str = "horovodrun-hosts") -> int:
    """``horovodrun-hosts HOSTFILE [--dry-run] [horovodrun options] -- COMMAND``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, command = _split_command(argv)
    parser = argparse.ArgumentParser(
        prog=prog, description=_LAUNCH_DESCRIPTION, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{prog} HOSTFILE [--dry-run] [--launcher PATH] [horovodrun options] -- COMMAND ...")
    _launch_arguments(parser)
    args, extra = parser.parse_known_args(ours)
    return _run(lambda: cmd_launch(args, extra, command), f"{prog}")


def _run(fn, name: str) -> int:
    try:
        return fn()
    except CommandError as err:
        print(f"{name}: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # bad files, specs and plans: the message names the problem
        print(f"{name}: {err}", file=sys.stderr)
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hvd-balance`` console command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    if argv and argv[0] == "launch":
        return launch_main(argv[1:], prog=f"{PROG} launch")
    parser = _parser()
    args = parser.parse_args(argv)
    return _run(lambda: args.func(args), f"{PROG} {args.command}")


if __name__ == "__main__":
    sys.exit(main())

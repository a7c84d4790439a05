"""The benchmark's driver: launch the jobs interleaved, collect, summarize; the command line."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..emulate import RANK_ENV, parse_slowdowns
from .figures import _median, share_of_ideal, summarize, summarize_job, targets
from .models import BATCH_NORMS, sync_batch_norm_available
from .plot import plot
from .settings import (_STOP_GRACE_S, ALL_STRATEGIES, COMPRESSIONS, DEFAULT_LEARNING_RATE,
                       HELDOUT, LEARNING_RATE, MODELS, PAIRED_LABELS, PAIRED_STRATEGIES, SMOKE,
                       STRATEGIES)
from .worker import run_worker

def _cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def job_command(args, strategy: str, job_out: str) -> List[str]:
    """The launcher command of one job."""
    cmd = [sys.executable, "-m", "hvd_balance.emulate", "--cpu-shares", args.shares,
           "--period-us", str(args.period_us)]
    if args.step_delay_ms:
        cmd += ["--step-delay-ms", args.step_delay_ms]
    if args.slowdown:
        cmd += ["--slowdown", ",".join(f"{k:g}" for k in args.slowdown)]
    cmd += ["--", sys.executable, "-m", "hvd_balance.bench", "--worker", "--strategy", strategy,
            "--model", args.model, "--epochs", str(args.epochs),
            "--global-batch", str(args.global_batch), "--samples", str(args.samples),
            "--seed", str(args.seed), "--lr", str(args.lr),
            "--job-out", job_out, "--batch-norm", args.batch_norm, "--heldout", str(args.heldout)]
    if args.benchmark_repeats is not None:
        cmd += ["--benchmark-repeats", str(args.benchmark_repeats)]
    if args.benchmark_batches:
        cmd += ["--benchmark-batches", args.benchmark_batches]
    if args.tf_data_autotune:
        cmd += ["--tf-data-autotune"]
    if args.compression != "none":
        cmd += ["--compression", args.compression]
    if args.patched_step_timer:
        cmd += ["--patched-step-timer"]
    if args.hosts:
        # Ranks on hosts of their own (a cluster, or scripts/cluster/netns-cluster's), whose
        # speeds are theirs: plain horovodrun over ssh, the worker command unchanged.
        horovodrun = Path(sys.executable).with_name("horovodrun")
        cmd = [str(horovodrun) if horovodrun.exists() else "horovodrun",
               "-np", str(hosts_ranks(args.hosts)), "-H", args.hosts, "--gloo",
               *cmd[cmd.index("--") + 1:]]
    return cmd


def hosts_ranks(hosts: str) -> int:
    """The number of ranks in a horovodrun host list, ``"hostA:2,hostB:1"`` -> 3."""
    total = 0
    for entry in hosts.split(","):
        name, _, slots = entry.rpartition(":")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise SystemExit(f"hvd_balance.bench: --hosts entry {entry!r} is not HOST:SLOTS")
        total += int(slots)
    return total


def run_job(cmd: List[str], env: Dict[str, str], log_path: str, timeout_s: float,
            ranks_are_children: bool = True) -> Dict[str, Any]:
    """Run one job; stop it (launcher first, so it removes its cgroups) past ``timeout_s``.

    ``others_cores`` is the CPU (in cores) that processes other than the job used meanwhile;
    ``None`` when the ranks are not this process's children (``--hosts``: they run under
    each host's sshd, so their CPU cannot be told from other people's)."""
    start, busy0, mine0 = time.perf_counter(), _cpu_busy_s(), _children_cpu_s()
    load0 = os.getloadavg()[0]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(_STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
    wall = time.perf_counter() - start
    machine = _cpu_busy_s() - busy0
    ours = _children_cpu_s() - mine0
    others = max(0.0, machine - ours) if ranks_are_children else None
    return {"returncode": proc.returncode, "timed_out": timed_out, "wall_s": wall,
            "load_avg_1m_before": load0, "load_avg_1m_after": os.getloadavg()[0],
            "cpu_s_ours": ours, "cpu_s_others": others,
            "others_cores": None if others is None else (others / wall if wall > 0 else 0.0)}


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def _exit_on_signal(signum, frame) -> None:
    """SIGTERM/SIGHUP on the driver: leave by an exception, so the running job is stopped
    (`run_job`'s ``finally``) instead of outliving the driver in its own session."""
    raise SystemExit(128 + signum)


def run_driver(args, argv: Sequence[str]) -> int:
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _exit_on_signal)
    shares = [float(s) for s in args.shares.split(",")]
    if args.hosts and hosts_ranks(args.hosts) != len(shares):
        raise SystemExit(f"hvd_balance.bench: --hosts {args.hosts} has {hosts_ranks(args.hosts)} "
                         f"ranks, --shares {args.shares} {len(shares)}: give one share per rank "
                         "(the hosts' own quotas, for the report)")
    if args.hosts and args.step_delay_ms:
        raise SystemExit("hvd_balance.bench: --step-delay-ms needs the emulation, not --hosts")
    if args.hosts and args.slowdown:
        raise SystemExit("hvd_balance.bench: --slowdown needs the emulation, not --hosts")
    delays = [float(d) for d in args.step_delay_ms.split(",")] if args.step_delay_ms else [0.0] * len(shares)
    strategies = [s.strip() for s in args.strategies.split(",")]
    for s in strategies:
        if s not in ALL_STRATEGIES:
            raise SystemExit(f"hvd_balance.bench: unknown strategy {s!r}; choose from {ALL_STRATEGIES}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    work = args.work_dir or tempfile.mkdtemp(prefix="jobs_", dir=out_dir)
    os.makedirs(work, exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env.update(RANK_ENV)
    env.update(dict(kv.split("=", 1) for kv in args.env))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    command = "python -m hvd_balance.bench " + shlex.join(argv)
    print(f"hvd_balance.bench: {command}", flush=True)
    jobs: List[Dict[str, Any]] = []
    failed = 0
    for rep in range(args.reps):
        for strategy in strategies:
            job_out = os.path.join(work, f"{strategy}_rep{rep}.json")
            log_path = os.path.join(work, f"{strategy}_rep{rep}.log")
            if os.path.exists(job_out):
                os.unlink(job_out)
            cmd = job_command(args, strategy, job_out)
            info = run_job(cmd, env, log_path, args.job_timeout, ranks_are_children=not args.hosts)
            job = {"strategy": strategy, "rep": rep, "command": shlex.join(cmd), "log": log_path, **info}
            if info["returncode"] == 0 and os.path.exists(job_out):
                with open(job_out) as f:
                    job["result"] = json.load(f)
                job["summary"] = summarize_job(job["result"])
                s = job["summary"]
                if s.get("paired"):
                    p = s["paired"]
                    print(f"  rep {rep} {strategy}: paper {p['paper']} default {p['default']}  step ms "
                          f"paper {_fmt_list(p['paper_step_s'], 1e3)} default "
                          f"{_fmt_list(p['default_step_s'], 1e3)}  pairs "
                          f"{_fmt_list(p['pair_ratios'], 1, '{:.3f}')}", flush=True)
                print(f"  rep {rep} {strategy:12s} batches {s['local_batches']}  epoch "
                      f"{s['steady_epoch_s']:.3f} s  acc {_fmt_acc(s.get('accuracy'))}  busy {_fmt_list(s['busy_s'], 1e3)} ms  wait "
                      f"{_fmt_list(s['wait_s'], 1e3)} ms  eff {s['efficiency']:.3f}  bench "
                      f"{s['start_cost_s']:.2f} s  others {_fmt_cores(info['others_cores'])}",
                      flush=True)
            else:
                failed += 1
                job["summary"] = None
                print(f"  rep {rep} {strategy}: FAILED (status {info['returncode']}"
                      f"{', timed out' if info['timed_out'] else ''}); log {log_path}:\n"
                      f"{_tail(log_path)}", file=sys.stderr, flush=True)
            jobs.append(job)
    report = {
        "command": command,
        "config": {"model": args.model, "shares": shares, "step_delay_ms": delays,
                   "slowdown": list(args.slowdown) if args.slowdown else None,
                   "reps": args.reps, "epochs": args.epochs, "global_batch": args.global_batch,
                   "samples": args.samples, "seed": args.seed, "strategies": strategies,
                   "batch_norm": args.batch_norm if args.model == "resnet" else None,
                   "heldout": args.heldout, "lr": args.lr,
                   "benchmark_batches": args.benchmark_batches,
                   "benchmark_repeats": args.benchmark_repeats, "period_us": args.period_us,
                   "tf_data_autotune": args.tf_data_autotune, "compression": args.compression,
                   "patched_step_timer": args.patched_step_timer, "worker_env": {
                       k: env[k] for k in sorted(set(RANK_ENV) | {kv.split("=", 1)[0] for kv in args.env})}},
        "machine": {"cores": os.cpu_count(), "others_cores_median": _median(
            [j["others_cores"] for j in jobs])},
        "jobs": jobs,
    }
    finish(report, args.out, args.plot)
    return 1 if failed else 0


def finish(report: Dict[str, Any], out: str, plot_path: Optional[str] = None) -> Dict[str, Any]:
    """Summarize ``report["jobs"]`` into ``report``, write it to ``out``, print it, chart it."""
    cfg = report["config"]
    for job in report["jobs"]:
        if job.get("result") is not None:
            job["summary"] = summarize_job(job["result"])
    summary = summarize(report["jobs"], cfg["strategies"], cfg["global_batch"])
    jobs = report.pop("jobs")
    report.update(summary)
    slowdown = cfg.get("slowdown")
    share_of = report.get("balanced_share_of_ideal")
    if share_of and slowdown and len(set(cfg["shares"])) == 1:
        # The ideal the factors alone give (rates r / k_i): the measured rates should be close.
        share_of["ideal_speedup_from_slowdown"] = (
            share_of["speedup"] / share_of_ideal(share_of["speedup"], [1 / k for k in slowdown]))
    report["targets"] = targets(summary, cfg["shares"], cfg["step_delay_ms"], cfg["epochs"],
                                slowdown)
    report["jobs"] = jobs  # last: the raw figures
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, out)
    print(format_summary(report), flush=True)
    print(f"hvd_balance.bench: wrote {out}", flush=True)
    if plot_path and any(report["strategies"].values()):
        plot(report, plot_path)
        print(f"hvd_balance.bench: wrote {plot_path}", flush=True)
    return report


def _fmt_list(values, scale=1.0, fmt="{:.1f}"):
    return "[" + ", ".join("-" if v is None else fmt.format(v * scale) for v in values) + "]"


def _fmt_acc(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _fmt_cores(value) -> str:
    return "n/a (ranks on other hosts)" if value is None else f"{value:.2f} cores"


def format_summary(report: Dict[str, Any]) -> str:
    """A plain-text table of the summary (also what BENCHMARKS.md tables are made from)."""
    lines = ["strategy      local batches         epoch s  speedup  of ideal  accuracy  busy ms/step (per rank)"
             "          wait ms/step (per rank)          eff.   start s  share  5-epoch s  busy/predicted"]
    for name, s in report["strategies"].items():
        if not s:
            lines.append(f"{name:12s}  (no successful job)")
            continue
        ratio = s.get("busy_over_predicted")
        lines.append(
            f"{name:12s}  {str(s['local_batches']):20s}  {s['epoch_s']:7.3f}  "
            f"{s.get('speedup', float('nan')):6.2f}x  {s.get('fraction_of_ideal', float('nan')):7.3f}  "
            f"{_fmt_acc(s.get('accuracy')):>8s}  "
            f"{_fmt_list(s['busy_s'], 1e3):30s}  {_fmt_list(s['wait_s'], 1e3):30s}  "
            f"{s['efficiency']:.3f}  {s['start_cost_s']:6.2f}  {s['benchmark_share']:.3f}  "
            f"{s.get('run_5_epochs_s') or float('nan'):9.2f}  "
            f"{'-' if ratio is None else _fmt_list(ratio, 1, '{:.2f}')}")
    ideal = report.get("ideal")
    if ideal:
        lines.append(f"ideal speedup {ideal['ideal_speedup']:.2f}x (rates "
                     f"{_fmt_list(ideal['samples_per_s'], 1, '{:.0f}')} samples/s, ideal epoch "
                     f"{ideal['ideal_epoch_s']:.3f} s)")
    for name, label in PAIRED_LABELS.items():
        paired = report.get(name)
        if not paired:
            continue
        interval = paired.get("interval_95")
        lines.append(f"{label} step time: {paired['paper_over_default_step']:.3f} "
                     f"(median of {sum(map(len, paired['pair_ratios_per_rep']))} pairs"
                     + (f", 95 % interval {interval['low']:.3f}-{interval['high']:.3f}"
                        if interval else "") +
                     f"; per job, its median paper step / median default step "
                     f"{_fmt_list(paired['ratio_per_rep'], 1, '{:.3f}')})")
    share_of = report.get("balanced_share_of_ideal")
    if share_of:
        from_factors = share_of.get("ideal_speedup_from_slowdown")
        lines.append(f"balanced share of ideal: {share_of['value']:.3f} (speedup "
                     f"{share_of['speedup']:.2f}x over uniform / ideal "
                     f"{share_of['ideal_speedup']:.2f}x from the uniform jobs' rates "
                     f"{_fmt_list(share_of['samples_per_s'], 1, '{:.0f}')} samples/s"
                     + (f"; the slowdown factors alone give {from_factors:.2f}x"
                        if from_factors else "") + ")")
    if report.get("balanced_vs_proportional"):
        lines.append(f"proportional / balanced epoch time: "
                     f"{report['balanced_vs_proportional']['epoch_time_ratio']:.3f}")
    for name, t in report.get("targets", {}).items():
        lines.append(f"target {name}: {t['value']:.3f} {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)




def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hvd_balance.bench",
        description="Benchmark plain Horovod (uniform), the paper's proportional rule and "
                    "hvd_balance (balanced) side by side on emulated mixed-speed ranks "
                    "(hvd_balance.emulate, needs root).",
        epilog="example: python -m hvd_balance.bench --model cnn --shares 1.0,0.25 --reps 3 "
               "--epochs 5 --global-batch 512 --samples 61440 --out results/bench.json "
               "--plot results/bench.png")
    p.add_argument("--model", choices=MODELS, default="cnn",
                   help="cnn (16x16x1 images), mlp (256 features), tiny (smoke tests), resnet "
                        "(a small ResNet with batch normalization on 32x32x3 images) or text "
                        "(an Embedding, sparse gradients, on token sequences)")
    p.add_argument("--batch-norm", choices=BATCH_NORMS, default="local",
                   help="resnet's batch normalization: sync (hvd_balance.SyncBatchNormalization, "
                        "statistics over the global batch) or local (Keras's, per rank); "
                        "default %(default)s")
    p.add_argument("--heldout", type=int, default=HELDOUT,
                   help="held-out samples the accuracy is measured on after training "
                        "(the same for every strategy; default %(default)s, 0: none)")
    p.add_argument("--shares", default=None,
                   help="per rank CPU share in cores (default 1.0,0.25; with --slowdown, 1 "
                        "for every rank: pinned to a core each, no quota binds)")
    p.add_argument("--slowdown", type=parse_slowdowns, default=None, metavar="K0,K1,...",
                   help="per rank, a factor >= 1 by which its compute is slowed while its "
                        "collectives run at full speed (hvd_balance.emulate --slowdown), e.g. "
                        "1,4; the summary then prints 'balanced share of ideal'")
    p.add_argument("--hosts", default=None, metavar="HOST:SLOTS,...",
                   help="run the ranks on these hosts with horovodrun -H over ssh instead of "
                        "emulating them here; their speeds are their own (--shares then only "
                        "labels the report, one per rank); e.g. on scripts/cluster/netns-cluster")
    p.add_argument("--step-delay-ms", default=None,
                   help="per rank fixed delay per training step, e.g. 0,15")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated, run in this order in every repetition; also "
                        "'static' (the benchmark's minmax plan, never re-planned), "
                        "'adaptive' (rebalance='epoch': balanced's default) "
                        "'telemetry' (no benchmark: equal batches, then re-planned every "
                        "third of an epoch), 'paired' (the paper's plan and the default's "
                        "found in one job, then alternated for --epochs epochs, an even number) "
                        "and 'control' (paired's A/A test: the same job with the paper's plan in "
                        "both slots)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each strategy")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=512, help="B, samples per step over all ranks")
    p.add_argument("--samples", type=int, default=61440, help="training samples per epoch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (SGD with momentum 0.9; Adam for text); default "
                        f"{DEFAULT_LEARNING_RATE}, resnet {LEARNING_RATE['resnet']}, text "
                        f"{LEARNING_RATE['text']}")
    p.add_argument("--benchmark-batches", default=None,
                   help="LoadBalancer benchmark sizes: samples (64,128) or multiples of B/N "
                        "(0.5x,1x); default: the LoadBalancer's own")
    p.add_argument("--benchmark-repeats", type=int, default=None,
                   help="LoadBalancer timed repeats per size (default: the LoadBalancer's own)")
    p.add_argument("--period-us", type=int, default=10_000,
                   help="CFS period of the CPU quotas (hvd_balance.emulate --period-us)")
    p.add_argument("--tf-data-autotune", action="store_true",
                   help="leave tf.data autotuning on for the training input (default: off)")
    p.add_argument("--compression", choices=COMPRESSIONS, default="none",
                   help="the gradients' compression in the allreduce (hvd.Compression.fp16 "
                        "halves the bytes, at a cast each way on every rank); every strategy; "
                        "default %(default)s")
    p.add_argument("--patched-step-timer", action="store_true",
                   help="no effect: benchmark.py times the backward pass since 36b3e9a; "
                        "accepted so the commands recorded in BENCHMARKS.md rerun as written")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment variable for the ranks (repeatable)")
    p.add_argument("--out", default="results/bench.json", help="the JSON report")
    p.add_argument("--plot", default=None, help="the PNG chart (none unless given)")
    p.add_argument("--work-dir", default=None, help="per-job JSON and logs (default: beside --out)")
    p.add_argument("--job-timeout", type=float, default=1200.0, help="seconds before a job is stopped")
    p.add_argument("--smoke", action="store_true",
                   help="a few seconds a job: the CNN, 2 ranks at 1.0,0.5, 1 repetition")
    p.add_argument("--from-json", metavar="REPORT",
                   help="recompute the summary, targets and chart of a report this module wrote "
                        "(its raw per-job figures), write it to --out, run nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", choices=ALL_STRATEGIES, help=argparse.SUPPRESS)
    p.add_argument("--job-out", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (``python -m hvd_balance.bench``, ``hvd-balance bench``); returns the status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.lr is None:
        args.lr = LEARNING_RATE.get(args.model, DEFAULT_LEARNING_RATE)
    if args.worker:
        return run_worker(args)
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        finish(report, args.out, args.plot)
        return 0
    if args.smoke:
        given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
        for key, value in SMOKE.items():
            if key == "shares" and args.slowdown:
                continue  # the slowdown alone makes the ranks unequal
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
    if args.shares is None:
        args.shares = (",".join(["1"] * len(args.slowdown)) if args.slowdown else "1.0,0.25")
    if args.slowdown and len(args.slowdown) != len(args.shares.split(",")):
        raise SystemExit(f"hvd_balance.bench: --slowdown "
                         f"{','.join(f'{k:g}' for k in args.slowdown)} has "
                         f"{len(args.slowdown)} values for the {len(args.shares.split(','))} "
                         f"ranks of --shares {args.shares}")
    for key in ("reps", "epochs", "global_batch", "samples", "benchmark_repeats"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise SystemExit(f"hvd_balance.bench: --{key.replace('_', '-')} must be >= 1; "
                             f"got {getattr(args, key)}")
    asked = [s.strip() for s in args.strategies.split(",")]
    paired = [s for s in PAIRED_STRATEGIES if s in asked]
    if paired:
        if args.epochs % 2:
            raise SystemExit(f"hvd_balance.bench: the {paired[0]} strategy compares its plans in "
                             f"pairs of epochs: --epochs must be even; got {args.epochs}")
        if args.samples // args.global_batch < 2:  # its first step of each epoch is left out
            raise SystemExit(f"hvd_balance.bench: the {paired[0]} strategy needs 2 steps an epoch or "
                             f"more; --samples {args.samples} gives "
                             f"{args.samples // args.global_batch} of --global-batch {args.global_batch}")
    if args.heldout < 0:
        raise SystemExit(f"hvd_balance.bench: --heldout must be >= 0; got {args.heldout}")
    if args.batch_norm == "sync" and args.model == "resnet" and not sync_batch_norm_available():
        raise SystemExit("hvd_balance.bench: --batch-norm sync needs hvd_balance.SyncBatchNormalization "
                         "(hvd_balance/keras/sync_batch_norm.py), which this checkout lacks; "
                         "use --batch-norm local")
    if args.samples < args.global_batch:
        raise SystemExit(f"hvd_balance.bench: --samples {args.samples} is less than one global "
                         f"batch ({args.global_batch})")
    return run_driver(args, argv)


if __name__ == "__main__":
    sys.exit(main())

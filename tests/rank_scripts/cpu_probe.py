"""Rank script: spin on the CPU for a fixed wall time, then print one JSON line.

The line reports the rank, iterations per second of a pure-Python loop (over the whole time
and the median over 0.25 s windows), CPU seconds per wall second, the cores the rank may run
on, its cpu cgroup and the hvd_balance env vars. Standard library only, no Horovod init, so
it starts fast under horovodrun.

Args:
    --seconds S: spin for S wall seconds (default 2).
    --fail-rank R: rank R exits with status 1 at once (default: none).
    --hang: after reporting, sleep until killed.
    --signal-launcher-rank R: rank R, 1 s after reporting, sends SIGTERM to the emulation
        launcher (the pid in its group's name ``hvd_balance.<pid>``), then hangs.
"""
import argparse
import json
import os
import signal
import statistics
import time

WINDOW_S = 0.25

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=2.0)
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--hang", action="store_true")
parser.add_argument("--signal-launcher-rank", type=int, default=None)
args = parser.parse_args()
rank = int(os.environ.get("HOROVOD_RANK", "-1"))
if rank == args.fail_rank:
    print(json.dumps({"rank": rank, "failing": True}), flush=True)
    raise SystemExit(1)

cpu_group = next((line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup")
                  if line.split(":", 2)[1] in ("cpu", "cpu,cpuacct", "cpuacct,cpu", "")), None)
iterations = 0
window_rates = []  # iterations per second in each WINDOW_S of wall time
window_start, window_iterations = time.monotonic(), 0
wall0, cpu0 = time.monotonic(), time.process_time()
while True:
    x = 0
    for i in range(2000):
        x += i
    iterations += 1
    window_iterations += 1
    now = time.monotonic()
    if now - window_start >= WINDOW_S:
        window_rates.append(window_iterations / (now - window_start))
        window_start, window_iterations = now, 0
    if now - wall0 >= args.seconds:
        break
wall_s, cpu_s = time.monotonic() - wall0, time.process_time() - cpu0
print(json.dumps({
    "rank": rank,
    "pid": os.getpid(),
    "iterations_per_s": iterations / wall_s,
    "median_iterations_per_s": statistics.median(window_rates or [iterations / wall_s]),
    "cpu_per_wall": cpu_s / wall_s,
    "affinity": sorted(os.sched_getaffinity(0)),
    "cpu_cgroup": cpu_group,
    "cpu_share": os.environ.get("HVD_BALANCE_CPU_SHARE"),
    "step_delay_ms": os.environ.get("HVD_BALANCE_STEP_DELAY_MS"),
    "slowdown": os.environ.get("HVD_BALANCE_SLOWDOWN"),
    "gloo_timeout_s": os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS"),
}), flush=True)
if rank == args.signal_launcher_rank:
    time.sleep(1)
    launcher_pid = int(cpu_group.split("/")[-2].split(".")[1])
    os.kill(launcher_pid, signal.SIGTERM)
if args.hang or rank == args.signal_launcher_rank:
    while True:
        time.sleep(60)

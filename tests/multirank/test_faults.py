"""Faults and bad input on real ranks: no hang, a clear error naming the cause on every rank,
and no checkpoint lost.

* A rank that raises, is SIGKILLed or is SIGSTOPped mid-epoch: every rank exits non-zero
  within 60 s, the output names the failed rank (hvd_balance.watchdog), and the checkpoint
  saved before the fault loads and training resumes from it.
* A checkpoint being written when another rank dies is finished, not cut off by the
  launcher's SIGTERM.
* Ranks that disagree (model size, global batch, seed, a plan for another world size) and
  corrupt or hostile plan files fail on every rank at train begin, before any step, and a
  YAML tag never constructs anything.
"""
import json
import math
import os
import re
import time

import pytest

from support import run_ranks

FIT = "tests/rank_scripts/fault_fit.py"
BAD_INPUT = "tests/rank_scripts/fault_bad_input.py"
BOUND_S = 60  # every rank must be gone this long after the fault at the latest


def fault_time(run) -> float:
    times = [float(l.split()[1]) for l in run.rank_lines(1) if l.startswith("FAULT ")]
    assert len(times) == 1, run.stdout[-4000:]
    return times[0]


def checkpoints(run):
    """``{epoch: eval loss}`` printed by rank 0 after each checkpoint."""
    return {int(l.split()[1]): float(l.split()[2]) for l in run.rank_lines(0) if l.startswith("CKPT ")}


def exit_codes(run):
    """Each rank's non-zero exit status as horovodrun reports it.

    A rank that exits by itself while horovodrun is terminating it can go unreported: the
    terminating thread (psutil's ``wait``) may reap the rank's shell before the thread blocked
    in ``Popen.wait`` does, which then reads 0 (ECHILD) and prints nothing (seen under load).
    Not anchored at a line start: each rank's thread prints its own status, and two threads'
    prints can share a line.
    """
    return {int(m.group(1)): int(m.group(2))
            for m in re.finditer(r"Process (\d+) exit with status code (-?\d+)\.", run.stdout)}


def crash(tmp_path, mode, launcher_args=()):
    out = tmp_path / "out"
    out.mkdir()
    run = run_ranks(FIT, np=2, args=[out, mode], timeout=240, launcher_args=launcher_args,
                    env={"HVD_BALANCE_WATCHDOG_DIR": tmp_path / "watchdog"})
    ended = time.time()
    assert run.returncode != 0, run.stdout[-4000:]
    assert "FINISHED" not in run.stdout
    assert ended - fault_time(run) < BOUND_S, run.stdout[-4000:]
    # The failed rank's status is reported; rank 0's may not be (see `exit_codes`), and its own
    # last words are checked by each test (`assert_rank0_names_rank1`).
    codes = exit_codes(run)
    assert codes.get(1, 0) != 0 and set(codes) <= {0, 1}, (codes, run.stdout[-6000:])
    assert not run.leftovers  # no rank outlived the launcher
    return run, out


def assert_rank0_names_rank1(run, cause):
    """Rank 0's last words name rank 1 and ``cause``: from its failed collective ("stops:"), or,
    when that takes longer than the watchdog's grace after the launcher's SIGTERM, from the
    grace's end ("stops on SIGTERM:")."""
    lines = [l for l in run.rank_lines(0, stream=None) if l.startswith("hvd_balance: rank 0 ")]
    assert lines and re.search(r"stops(?: on SIGTERM)?: rank 1 " + re.escape(cause), lines[-1]), \
        run.stdout[-4000:]


@pytest.mark.stacks
@pytest.mark.timeout(420)
def test_a_rank_that_raises_mid_epoch_stops_every_rank_and_the_checkpoint_resumes(tmp_path):
    run, out = crash(tmp_path, "raise")
    own = [l for l in run.rank_lines(1, stream=None) if l.startswith("hvd_balance: rank 1 ")]
    assert own and own[-1].endswith("failed: RuntimeError: injected failure on rank 1; stopping the job")
    assert_rank0_names_rank1(run, "failed: RuntimeError: injected failure on rank 1")
    assert checkpoints(run).keys() == {1}  # epoch 1 ended, the fault came in epoch 2
    assert not (tmp_path / "watchdog").exists() or not any((tmp_path / "watchdog").iterdir())

    resumed = run_ranks(FIT, np=2, args=[out, "resume"], timeout=150)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    saved_loss = checkpoints(run)[1]
    results = resumed.results()
    assert results.keys() == {0, 1}, resumed.stdout[-4000:]
    for rank in range(2):
        loaded = [l.split() for l in resumed.rank_lines(rank) if l.startswith("LOADED ")]
        # the very weights saved, and the optimizer's state (its step counter) with them
        assert loaded == [["LOADED", "1", f"{saved_loss:.8f}", "10"]]
        result = results[rank]
        assert result["initial_epoch"] == 1 and result["epochs_run"] == 3
        assert all(math.isfinite(v) for v in result["loss"])
        assert result["eval_loss"] < saved_loss  # it trains on from there


@pytest.mark.timeout(300)
def test_a_rank_killed_with_sigkill_is_named_and_the_checkpoint_loads(tmp_path):
    run, out = crash(tmp_path, "kill")
    assert_rank0_names_rank1(run, "died: pid ")
    assert checkpoints(run).keys() == {1}

    import numpy as np
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.load_weights(out / "ckpt-01.weights.h5")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(700, 10)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y[640:], model(x[640:]))
    assert float(loss) == pytest.approx(checkpoints(run)[1], abs=1e-7)


@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_after_the_gloo_timeout(tmp_path):
    # A rank that stops responding (SIGSTOP: what a vanished host looks like) keeps its
    # sockets open; the peers' collective fails after the Gloo timeout (10 s here).
    run, _ = crash(tmp_path, "stop", launcher_args=["--gloo-timeout-seconds", "10"])
    assert_rank0_names_rank1(run, "is stopped: pid ")


@pytest.mark.timeout(300)
@pytest.mark.slow  # a second scenario of a behaviour CI tests: in the long runs
def test_a_checkpoint_being_written_when_another_rank_dies_is_finished(tmp_path):
    run, out = crash(tmp_path, "save_interrupted")
    assert any(l.startswith("hvd_balance: rank 0 got SIGTERM") for l in run.rank_lines(0, None))
    assert any(l.startswith("SAVED ") for l in run.rank_lines(0)), run.stdout[-4000:]
    assert (out / "ckpt-slow.weights.h5").read_bytes() == (out / "staged.weights.h5").read_bytes()
    assert_rank0_names_rank1(run, "died: pid ")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_the_watchdog_the_launcher_cuts_a_checkpoint_short(tmp_path):
    """Why the watchdog handles SIGTERM: horovodrun terminates the survivors at once."""
    out = tmp_path / "out"
    out.mkdir()
    run = run_ranks(FIT, np=2, args=[out, "save_interrupted", "--no-watchdog"], timeout=240)
    assert run.returncode != 0
    assert not any(l.startswith("SAVED ") for l in run.rank_lines(0))
    assert exit_codes(run).get(0, 143) == 143  # SIGTERM (or unreported, see exit_codes)
    written = (out / "ckpt-slow.weights.h5").stat().st_size
    assert written < (out / "staged.weights.h5").stat().st_size


def cases(run):
    out = {}
    for rank in (0, 1):
        for line in run.rank_lines(rank):
            if line.startswith("CASE "):
                case = json.loads(line[len("CASE "):])
                out.setdefault(case["case"], {})[rank] = case
    return out


@pytest.mark.timeout(240)
def test_ranks_that_disagree_fail_together_before_any_step():
    run = run_ranks(BAD_INPUT, np=2, args=["disagree"], timeout=180)
    assert run.returncode == 0, run.stdout[-4000:]
    expected = {
        "model_size": "ValueError: parameters differs across ranks: rank 0: 210, rank 1: 223",
        "global_batch": "ValueError: global_batch_size differs across ranks: rank 0: 64, rank 1: 48",
        "seed": "ValueError: seed differs across ranks: rank 0: 0, rank 1: 1",
        "plan_world_size": "the plan does not fit this job: it is for 3 ranks, the job has 2",
    }
    got = cases(run)
    assert got.keys() == expected.keys()
    for case, message in expected.items():
        per_rank = got[case]
        assert per_rank[0]["error"] == per_rank[1]["error"], per_rank
        assert message in per_rank[0]["error"], per_rank
        assert per_rank[0]["steps"] == per_rank[1]["steps"] == 0  # before any training step
        assert max(per_rank[r]["seconds"] for r in (0, 1)) < 20  # a cheap check, no benchmark


@pytest.mark.timeout(240)
def test_corrupt_or_hostile_plan_files_fail_on_every_rank_and_run_nothing(tmp_path):
    from hvd_balance import Plan

    good = tmp_path / "good.yaml"
    Plan.from_batch_sizes([40, 24]).save(str(good))
    text = good.read_text()
    pwned = [tmp_path / "pwned1", tmp_path / "pwned2"]
    files = {
        "object_tag.yaml": (f'!!python/object/apply:os.system ["touch {pwned[0]}"]\n',
                            "YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed"),
        "tag_in_plan.yaml": (text.replace("local_batch: 40", "local_batch: !!python/object/apply:"
                                          f'os.system ["touch {pwned[1]}"]'),
                             "is not allowed (safe loading only: plain data, no objects) (line 10"),
        "truncated.yaml": (text[: text.index("local_batch: 24") + 5],
                           "is not valid YAML (truncated or corrupt?)"),
        "wrong_types.yaml": (text.replace("local_batch: 40", 'local_batch: "forty"'),
                             "ranks[0].local_batch must be an integer >= 0; got 'forty'"),
        "negative.yaml": (text.replace("local_batch: 40", "local_batch: -8")
                          .replace("global_batch_size: 64", "global_batch_size: 16"),
                          "ranks[0].local_batch must be an integer >= 0; got -8"),
        "binary.yaml": (bytes(range(256)), "is not UTF-8 text"),
        "missing.yaml": (None, "cannot read plan file"),
    }
    paths = []
    for name, (content, _) in files.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        paths.append(path)
    run = run_ranks(BAD_INPUT, np=2, args=["plans", *paths], timeout=180)
    assert run.returncode == 0, run.stdout[-4000:]
    got = cases(run)
    assert got.keys() == files.keys()
    for name, (_, message) in files.items():
        per_rank = got[name]
        assert per_rank[0]["error"] == per_rank[1]["error"], per_rank
        assert per_rank[0]["error"].startswith("ValueError: ") and message in per_rank[0]["error"], per_rank
        assert per_rank[0]["steps"] == per_rank[1]["steps"] == 0
    assert not any(p.exists() for p in pwned)  # nothing was executed


# -- the watchdog's logic, on one process --------------------------------------------------------

@pytest.fixture
def dog(tmp_path, monkeypatch):
    from hvd_balance import watchdog

    monkeypatch.setattr(watchdog, "_installed", None)
    dog = watchdog._Watchdog(str(tmp_path), interval_s=1.0, grace_s=0.5, term_grace_s=1.0)
    assert watchdog._private_directory(dog.directory)
    assert os.stat(dog.directory).st_mode & 0o777 == 0o700
    dog._write()
    return dog


def status(dog, rank, host, pid, state="running", error="", age_s=0.0):
    record = {"rank": rank, "job": dog.job, "host": host, "pid": pid, "state": state,
              "error": error, "beat": 1, "time": time.time() - age_s}
    with open(os.path.join(dog.directory, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    return {"rank": rank, "host": host, "pid": pid}


@pytest.mark.timeout(60)
def test_watchdog_tells_collective_failures_from_own_errors():
    from hvd_balance.keras.watchdog import _is_collective_failure

    assert _is_collective_failure(RuntimeError("Graph execution error:\n\nHorovod has been shut "
                                               "down. This was caused by an exception"))
    wrapped = ValueError("while saving")
    wrapped.__cause__ = RuntimeError("[HorovodAllreduce] gloo: Connection reset by peer")
    assert _is_collective_failure(wrapped)
    assert not _is_collective_failure(RuntimeError("injected failure on rank 1"))
    assert not _is_collective_failure(ValueError("parameters differs across ranks"))


@pytest.mark.timeout(60)
def test_watchdog_names_failed_dead_stopped_and_silent_peers(dog):
    import subprocess
    import signal as sig

    me = dog.peers[0]
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(sleeper.pid, sig.SIGSTOP)
        time.sleep(0.2)
        dead = subprocess.Popen(["true"])
        dead.wait()
        dog.peers = [me,
                     status(dog, 1, dog.host, dead.pid),                       # died
                     status(dog, 2, dog.host, sleeper.pid),                    # stopped
                     status(dog, 3, "far-away-host", 1, age_s=90.0),           # silent long ago
                     status(dog, 4, "far-away-host", 2),                       # silent from now
                     {"rank": 5, "host": "other-host", "pid": 1}]              # unknown
        found, unknown = dog.culprits()
        described = dict(found)
        assert described[1].startswith(f"died: pid {dead.pid} on {dog.host} is gone")
        assert described[2].startswith(f"is stopped: pid {sleeper.pid}")
        assert described[3].startswith("stopped responding: no heartbeat for 90 s")
        assert 4 not in described and unknown == [5]
        time.sleep(dog.stale_s + 0.2)  # rank 4's heartbeat does not advance while watched
        described = dict(dog.culprits()[0])
        # (one more second if this thread was held up between the status write and the sleep)
        assert re.match(rf"stopped responding: no heartbeat for ({dog.stale_s:.0f}|{dog.stale_s + 1:.0f}) s",
                        described[4]), described[4]
        # A peer that reported its own failure is named before the others, alone.
        status(dog, 3, "far-away-host", 1, state="failed", error="RuntimeError: boom")
        assert dog.explain(0.0) == "rank 3 failed: RuntimeError: boom"
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.timeout(60)
def test_watchdog_ignores_status_files_that_are_not_its_jobs(dog):
    """Its directory is private (0700); a file that does not parse, or is another job's, or
    holds another rank, or a field out of its schema, names nobody."""
    dog.peers = [dog.peers[0], {"rank": 1, "host": "far-away-host", "pid": 1}]
    path = os.path.join(dog.directory, "rank1.json")
    good = {"rank": 1, "job": dog.job, "host": "far-away-host", "pid": 1, "state": "failed",
            "error": "RuntimeError: boom", "beat": 1, "time": time.time()}
    for bad in ["{not json", json.dumps({**good, "job": "another"}), json.dumps({**good, "rank": 2}),
                json.dumps({**good, "error": "x\n" * 600}), json.dumps({**good, "beat": "1"}),
                json.dumps({**good, "time": float("nan")}), json.dumps({**good, "extra": 1})]:
        with open(path, "w") as f:
            f.write(bad)
        assert dog.culprits() == ([], [1]), bad
    with open(path, "w") as f:
        json.dump(good, f)
    assert dog.explain(0.0) == "rank 1 failed: RuntimeError: boom"


@pytest.mark.timeout(60)
def test_watchdog_keeps_no_status_files_in_a_directory_others_can_open(tmp_path):
    from hvd_balance.keras import watchdog

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert not watchdog._private_directory(str(shared))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    assert not watchdog._private_directory(str(tmp_path / "link"))
    assert watchdog._private_directory(str(tmp_path / "new"))
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700


@pytest.mark.timeout(60)
def test_watchdog_says_when_nobody_can_be_blamed(dog):
    dog.peers = [dog.peers[0], {"rank": 1, "host": "other-host", "pid": 1}]
    text = dog.explain(0.2)
    assert text.startswith("no other rank was found failed, dead or silent")
    assert "ranks [1] on other hosts cannot be checked from here" in text


def _wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_watchdog_names_a_peer_on_another_host_lost_over_the_network(dog):
    """The heartbeat over UDP: a peer on another host heard once and then silent for
    ``lost_s`` is lost (with its host); one that said it exited, or never heard (UDP may be
    blocked between hosts), is not; and this rank's own status goes to its peers."""
    from hvd_balance import channel
    from hvd_balance.keras.watchdog import _Heartbeats

    from support.channels import linked

    secret = b"k" * 32
    ends = linked([channel.Channel("watchdog", secret, 0, 3, dog._is_record),
                   channel.Channel("watchdog", secret, 1, 3, lambda record, rank: True),
                   channel.Channel("watchdog", secret, 2, 3, lambda record, rank: True)])
    dog.channel, far, mute = _Heartbeats(ends[0]), _Heartbeats(ends[1]), ends[2]
    try:
        dog.lost_s = 1.0
        dog.remote = [{"rank": 1, "host": "far-host", "pid": 7},
                      {"rank": 2, "host": "mute-host", "pid": 8}]
        dog.peers = [dog.peers[0], *dog.remote]
        dog.channel.watch([1, 2])
        far.watch([0])
        record = {"rank": 1, "job": dog.job, "host": "far-host", "pid": 7, "state": "running",
                  "error": "", "beat": 1, "time": time.time()}
        far.send(record)
        _wait_for(lambda: dog.channel.record(1) is not None)
        assert dog.lost_peers() == []
        dog._write()  # this rank's status reaches the peer too
        _wait_for(lambda: far.record(dog.rank) is not None)
        assert far.record(dog.rank)["state"] == "running"
        time.sleep(max(dog.lost_s, dog.stale_s) + 0.2)
        lost = dict(dog.lost_peers())
        assert list(lost) == [1]  # rank 2 was never heard
        assert re.match(r"on far-host \(pid 7\): nothing heard over the network for \d+ s, last "
                        r"state running", lost[1]), lost[1]
        assert dict(dog.culprits()[0])[1].startswith("stopped responding: nothing heard over "
                                                     "the network")
        far.send({**record, "state": "exited", "beat": 2})
        _wait_for(lambda: dog.channel.record(1)["state"] == "exited")
        assert dog.lost_peers() == []
    finally:
        far.channel.close()
        mute.close()
        dog.channel.channel.close()

"""Plan: the check against a running job, the table, and plan files (round trip, refusals)."""
import os
import subprocess
import sys

import pytest
import yaml

from hvd_balance.core import plan as plan_file
from hvd_balance.core.plan import Plan, PlanMismatchError
from hvd_balance.core.planner import plan_batches

CURVES = [[(8, 0.010), (32, 0.030)], [(8, 0.050), (32, 0.200)], [(8, 0.040), (32, 0.150)]]
HOSTS = ("node1", "node1", "node2")
DEVICES = ("gpu:0 (NVIDIA A100)", "cpu (4 threads)", "cpu (4 threads)")


def full_plan(**kw):
    args = dict(max_batch_sizes=[48, None, 32], hosts=HOSTS, devices=DEVICES)
    args.update(kw)
    return plan_batches(CURVES, 64, **args)


# ---------------------------------------------------------------------------- check / load


@pytest.mark.timeout(30)
def test_check_returns_the_plan_when_it_fits():
    plan = full_plan()
    assert plan.check(3, 64, list(HOSTS)) is plan
    assert plan.mismatches(3, 64, HOSTS) == []
    assert Plan.from_batch_sizes([3, 4]).check(2, 7, ["x", "y"])  # a plan without hosts: not compared


@pytest.mark.timeout(30)
@pytest.mark.parametrize("job, message", [
    (dict(world_size=4), "the plan does not fit this job: it is for 3 ranks, the job has 4"),
    (dict(world_size=3, global_batch_size=128),
     "the plan does not fit this job: its global batch is 64, the job's is 128"),
    (dict(world_size=3, hosts=["node1", "node1", "node3"]),
     "the plan does not fit this job: its hosts differ (rank 2: plan host 'node2', job host 'node3')"),
    (dict(world_size=3, hosts=["node1", "node2", "node1"]),
     "its hosts differ (rank 1: plan host 'node1', job host 'node2'; rank 2: plan host 'node2', job host "
     "'node1'; the same hosts in another order: launch the ranks in the order the plan was made with)"),
    (dict(world_size=3, hosts=["node1", "node1"]), "the job's host list has 2 entries for 3 ranks"),
    (dict(world_size=2, global_batch_size=32),
     "it is for 3 ranks, the job has 2; its global batch is 64, the job's is 32"),
])
def test_every_mismatch_is_named(job, message):
    with pytest.raises(PlanMismatchError) as err:
        full_plan().check(**job)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.timeout(30)
def test_many_host_differences_are_counted_not_all_listed():
    plan = Plan.from_batch_sizes([1] * 8, hosts=tuple(f"a{i}" for i in range(8)))
    with pytest.raises(PlanMismatchError) as err:
        plan.check(8, hosts=[f"b{i}" for i in range(8)])
    text = str(err.value)
    assert "rank 4: plan host 'a4', job host 'b4'; and 3 more ranks" in text
    assert "rank 5:" not in text


@pytest.mark.timeout(30)
def test_load_checks_the_job_and_names_the_file(tmp_path):
    path = str(tmp_path / "plan.yaml")
    full_plan().save(path)
    assert Plan.load(path, world_size=3, global_batch_size=64, hosts=HOSTS) == full_plan()
    with pytest.raises(PlanMismatchError) as err:
        Plan.load(path, world_size=3, global_batch_size=64, hosts=["node1", "node9", "node2"])
    assert str(err.value) == (f"plan file {path!r} does not fit this job: its hosts differ "
                              f"(rank 1: plan host 'node1', job host 'node9')")
    with pytest.raises(ValueError, match="pass world_size"):
        Plan.load(path, global_batch_size=64)


# ---------------------------------------------------------------------------- round trip


@pytest.mark.timeout(30)
def test_round_trip_keeps_every_field(tmp_path):
    plan = full_plan(benchmark_s=2.5)
    path = tmp_path / "plan.yaml"
    assert plan.save(str(path)) == str(path)
    again = Plan.load(str(path))
    assert again == plan
    assert again.curves == plan.curves and again.predicted_step_s == plan.predicted_step_s
    assert os.listdir(tmp_path) == ["plan.yaml"]  # the temporary file was renamed, not left


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plan", [
    Plan.from_batch_sizes([5, 17, 42]),
    Plan.uniform(10, 3),
    plan_batches([300.0, 100.0], 64, max_batch_sizes=[None, None]),
])
def test_round_trip_of_sparse_plans(tmp_path, plan):
    path = str(tmp_path / "p.yaml")
    plan.save(path)
    assert Plan.load(path) == plan


@pytest.mark.timeout(30)
def test_file_holds_what_a_reader_needs(tmp_path):
    path = str(tmp_path / "plan.yaml")
    plan = full_plan()
    plan.save(path)
    data = yaml.safe_load(open(path))
    assert data["format_version"] == plan_file.FORMAT_VERSION == 1
    assert data["world_size"] == 3 and data["global_batch_size"] == 64 and data["method"] == "minmax"
    assert set(data["made_with"]) >= {"hvd_balance", "python", "tensorflow", "horovod"}
    assert data["made_with"]["tensorflow"] == installed_tensorflow()
    assert data["made_with"]["horovod"] == "0.28.1"
    r0 = data["ranks"][0]
    assert r0["rank"] == 0 and r0["host"] == "node1" and r0["device"] == "gpu:0 (NVIDIA A100)"
    assert r0["local_batch"] == plan.batch_sizes[0] and r0["weight"] == plan.weights[0]
    assert r0["max_batch_size"] == 48 and data["ranks"][1]["max_batch_size"] is None
    assert r0["curve"] == [[8, 0.01], [32, 0.03]]
    pf = plan_file.read(path)
    assert pf.made_with == data["made_with"] and pf.created == data["created"] and pf.path == path


def installed_tensorflow() -> str:
    """The TensorFlow version of this stack, read as the plan file must read it (no import)."""
    from importlib import metadata

    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise AssertionError("no TensorFlow distribution installed")


@pytest.mark.timeout(60)
def test_versions_do_not_import_tensorflow():
    code = ("import sys; from hvd_balance.core import plan as plan_file; v = plan_file.versions(); "
            "print('tensorflow' in sys.modules, v['tensorflow'], v['horovod'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    imported, tf_version, hvd_version = out.stdout.split()
    assert imported == "False" and tf_version == installed_tensorflow() and hvd_version == "0.28.1"


@pytest.mark.timeout(30)
def test_table_shows_hosts_devices_and_caps():
    lines = full_plan().table().splitlines()
    assert lines[0].startswith("plan (minmax): 3 ranks, global batch 64, predicted step")
    assert lines[1].split() == ["rank", "host", "device", "samples/s", "local", "batch", "weight",
                                "pred.", "step", "ms", "max", "batch"]
    assert "node1  gpu:0 (NVIDIA A100)" in lines[3] and lines[3].rstrip().endswith("48")
    assert "node2  cpu (4 threads)" in lines[5] and lines[5].rstrip().endswith("32")
    assert lines[4].rstrip().endswith("-")  # uncapped rank
    assert "max batch" not in Plan.from_batch_sizes([1, 2]).table()


# ---------------------------------------------------------------------------- refusals


def valid_text():
    return plan_file.to_yaml(full_plan(), made_with={"hvd_balance": "0.1.0"}, created="2025-01-01T00:00:00Z")


def edit(old, new, count=1):
    text = valid_text()
    assert old in text, old
    return text.replace(old, new, count)


BAD = {
    "python tag": ("!!python/object/apply:os.system ['echo pwned']\n",
                   "YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed"),
    "python tag inside": (edit("method: minmax", "method: !!python/name:os.system ''"),
                          "YAML tag 'tag:yaml.org,2002:python/name:os.system' is not allowed"),
    "alias": (edit("world_size: 3", "world_size: &n 3\nbenchmark_x: *n"), "anchors and aliases"),
    "billion laughs": ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                       "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n", "anchors and aliases"),
    "duplicate key": (edit("  local_batch: ", "  local_batch: 7\n  local_batch: "), "duplicate key 'local_batch'"),
    "truncated mid-token": (valid_text()[: valid_text().index("curve:") + 12], "not valid YAML"),
    "truncated rank list": (valid_text()[: valid_text().rindex("- rank: 2")], "world_size is 3 but 2 ranks are listed"),
    "truncated before ranks": (valid_text()[: valid_text().index("ranks:")], "it has no 'ranks' (truncated file?)"),
    "negative batch": (edit("local_batch: 48", "local_batch: -4"), "ranks[0].local_batch must be an integer >= 0; got -4"),
    "zero batch, weight kept": (edit("local_batch: 48", "local_batch: 0"), "ranks[0].weight is 0.75 but local_batch / global_batch_size is 0/64"),
    "bool batch": (edit("local_batch: 48", "local_batch: true"), "ranks[0].local_batch must be an integer >= 0; got True"),
    "string global batch": (edit("global_batch_size: 64", "global_batch_size: '64'"),
                            "global_batch_size must be an integer >= 1; got '64'"),
    "float batch": (edit("local_batch: 48", "local_batch: 47.5"), "ranks[0].local_batch must be an integer >= 0; got 47.5"),
    "list batch": (edit("local_batch: 48", "local_batch: [48]"), "ranks[0].local_batch must be an integer >= 0; got [48]"),
    "weight edited": (edit("weight: 0.75", "weight: 0.5"), "ranks[0].weight is 0.5 but local_batch / global_batch_size is 48/64"),
    "nan time": (edit("- [8, 0.01]", "- [8, .nan]"), "ranks[0].curve[0] seconds must be finite"),
    "zero time": (edit("- [8, 0.01]", "- [8, 0]"), "ranks[0].curve[0] seconds must be > 0"),
    "bad point": (edit("- [8, 0.01]", "- [8, 0.01, 3]"), "ranks[0].curve[0] must be a [local_batch, seconds] pair"),
    "empty curve": (edit("  curve:\n  - [8, 0.01]\n  - [32, 0.03]", "  curve: []"), "ranks[0].curve must be a non-empty list"),
    "unknown key": (edit("local_batch:", "local_bach:"), "unknown key 'local_bach' in ranks[0]; known keys: rank, host"),
    "unknown top key": (edit("method: minmax", "methdo: minmax"), "unknown key 'methdo'; known keys: format_version"),
    "no format_version": (edit("format_version: 1\n", ""), "no 'format_version': not an hvd_balance plan file"),
    "newer format": (edit("format_version: 1", "format_version: 2"), "format_version 2 was written by a newer hvd_balance"),
    "empty": ("", "it is empty"),
    "comment only": ("# nothing\n", "it is empty"),
    "list at top": ("- 1\n- 2\n", "it must hold a mapping at the top; got list"),
    "sum": (edit("local_batch: 48", "local_batch: 47").replace("weight: 0.75", "weight: 0.734375"),
            "add up to 63, not global_batch_size 64"),
    "over cap": (edit("max_batch_size: 48", "max_batch_size: 40"), "ranks[0].local_batch 48 exceeds its max_batch_size 40"),
    "host missing": (edit("  host: node1\n", ""), "'host' is given for some ranks but not for ranks [0]"),
    "host not text": (edit("host: node2", "host: 7"), "ranks[2].host must be a non-empty string; got 7"),
    "rank order": (edit("- rank: 1", "- rank: 2"), "ranks[1] says rank: 2; ranks must be listed in order 0..2"),
    "ranks not a list": (valid_text()[: valid_text().index("ranks:")] + "ranks: 3\n", "ranks must be a list"),
    "rank not a mapping": (valid_text()[: valid_text().index("ranks:")] + "ranks: [1, 2, 3]\n", "ranks[0] must be a mapping"),
    "world size zero": (edit("world_size: 3", "world_size: 0"), "world_size must be an integer >= 1; got 0"),
    "negative benchmark": (edit("benchmark_s: 0.0", "benchmark_s: -1.0"), "benchmark_s must be >= 0.0"),
    "deep nesting": ("a: " + "[" * 5000 + "]" * 5000 + "\n", "is nested too deeply to be a plan"),
    "deep block nesting": ("- " * 3000 + "x\n", "is nested too deeply to be a plan"),
    "made_with list": (edit("made_with: {hvd_balance: 0.1.0}", "made_with: [1]"),
                       "made_with must be a mapping of package to version; got list [1]"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_are_refused_with_the_reason(tmp_path, case):
    text, message = BAD[case]
    path = str(tmp_path / "bad.yaml")
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ValueError) as err:
        Plan.load(path)
    assert not isinstance(err.value, PlanMismatchError)
    assert str(err.value).startswith(f"plan file {path!r}"), str(err.value)
    assert message in str(err.value), str(err.value)


@pytest.mark.timeout(30)
def test_unreadable_and_binary_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read plan file .*missing.yaml"):
        Plan.load(str(tmp_path / "missing.yaml"))
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        Plan.load(str(path))


@pytest.mark.timeout(30)
def test_tag_in_file_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError):
        Plan.load(str(path))
    assert not marker.exists()


@pytest.mark.timeout(30)
def test_a_valid_hand_written_file_loads():
    text = """
format_version: 1
world_size: 2
global_batch_size: 10
ranks:
- {local_batch: 7}
- {local_batch: 3, weight: 0.3}
"""
    pf = plan_file.parse(text)
    assert pf.plan.batch_sizes == (7, 3) and pf.plan.method == "given" and pf.made_with == {}


# ---------------------------------------------------------------------------- floors

def floored_text():
    plan = full_plan(min_batch_sizes=[None, 8, 8])
    return plan, plan_file.to_yaml(plan, made_with={"hvd_balance": "0.1.0"}, created="2025-01-01T00:00:00Z")


@pytest.mark.timeout(30)
def test_floors_round_trip_and_show_in_the_file_and_table(tmp_path):
    plan, text = floored_text()
    assert plan.min_batch_sizes == (1, 8, 8) and min(plan.batch_sizes[1:]) >= 8
    path = str(tmp_path / "plan.yaml")
    plan.save(path)
    assert Plan.load(path) == plan
    data = yaml.safe_load(open(path))
    assert [r["min_batch_size"] for r in data["ranks"]] == [1, 8, 8]
    header = plan.table().splitlines()[1].split()
    assert header[-4:] == ["min", "batch", "max", "batch"]


@pytest.mark.timeout(30)
def test_a_file_without_floors_loads_with_none():
    pf = plan_file.parse(valid_text())
    assert "min_batch_size" not in valid_text() and pf.plan.min_batch_sizes is None
    assert pf.plan == full_plan()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("old, new, message", [
    ("min_batch_size: 8", "min_batch_size: 40", "rank 1: ranks[1].local_batch {b1} is below its min_batch_size 40"),
    ("min_batch_size: 1", "min_batch_size: 0", "ranks[0].min_batch_size must be an integer >= 1; got 0"),
    ("min_batch_size: 1", "min_batch_size: 4.5", "ranks[0].min_batch_size must be an integer >= 1; got 4.5"),
])
def test_a_plan_violating_its_floors_is_refused_naming_the_rank(old, new, message):
    plan, text = floored_text()
    assert old in text
    text = text.replace(old, new, 1)
    with pytest.raises(ValueError) as err:
        plan_file.parse(text, source="p.yaml")
    assert message.format(b1=plan.batch_sizes[1]) in str(err.value), str(err.value)
    d = plan.to_dict()
    d["min_batch_sizes"] = [1, plan.batch_sizes[1] + 1, 8]
    with pytest.raises(ValueError, match=rf"rank 1: ranks\[1\].local_batch {plan.batch_sizes[1]} is below"):
        Plan.from_dict(d)


@pytest.mark.timeout(30)
def test_a_floor_above_its_cap_is_refused_naming_the_rank():
    plan, text = floored_text()
    # rank 2 is capped at 32: its batch is at most 32, so a floor of 33 cannot hold
    edited = text.replace("max_batch_size: 32\n  min_batch_size: 8", "max_batch_size: 32\n  min_batch_size: 33")
    assert edited != text
    with pytest.raises(ValueError, match=rf"rank 2: ranks\[2\].local_batch {plan.batch_sizes[2]} is "
                                         r"below its min_batch_size 33"):
        plan_file.parse(edited)

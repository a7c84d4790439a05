"""The cores a process may use, from its cgroup's CPU quota and its affinity (no TensorFlow)."""
import os

import pytest

from hvd_balance.core.cpu_allowance import allowed_cores, cpu_group_dirs, quota_cores

pytestmark = pytest.mark.timeout(60)

V1_MOUNTS = ("25 1 0:23 / /sys/fs/cgroup rw - tmpfs tmpfs ro\n"
             "30 25 0:26 / {mount} rw - cgroup cgroup rw,cpu,cpuacct\n"
             "31 25 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")


def fake_proc(tmp_path, mountinfo, cgroup):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "cgroup").write_text(cgroup)
    return str(proc)


def write(path, **files):
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text)


def test_the_tightest_v1_quota_on_the_group_or_above_it_holds(tmp_path):
    mount = tmp_path / "cpu"
    write(mount, cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    write(mount / "hvd_balance.7", cpu_cfs_quota_us="150000\n", cpu_cfs_period_us="100000\n")
    write(mount / "hvd_balance.7" / "rank1", cpu_cfs_quota_us="2500\n", cpu_cfs_period_us="10000\n")
    proc = fake_proc(tmp_path, V1_MOUNTS.format(mount=mount),
                     "2:cpu,cpuacct:/hvd_balance.7/rank1\n0::/\n")
    affinity = len(os.sched_getaffinity(0))
    assert allowed_cores(proc) == pytest.approx(min(0.25, affinity))
    (mount / "hvd_balance.7" / "rank1" / "cpu.cfs_quota_us").write_text("-1\n")
    assert allowed_cores(proc) == pytest.approx(min(1.5, affinity))


def test_a_v2_quota_and_a_container_that_sees_its_group_as_the_root(tmp_path):
    mount = tmp_path / "cg2"
    write(mount, cpu_max="max 100000\n")
    write(mount / "pod", cpu_max="50000 100000\n")
    # The container's mount root is its own group /pod: /proc/self/cgroup says /pod too.
    mountinfo = f"40 25 0:30 /pod {mount / 'pod'} rw - cgroup2 cgroup2 rw\n"
    assert cpu_group_dirs(mountinfo, "0::/pod\n") == [(2, str(mount / "pod"))]
    proc = fake_proc(tmp_path, mountinfo, "0::/pod\n")
    assert allowed_cores(proc) == pytest.approx(min(0.5, len(os.sched_getaffinity(0))))


def test_no_quota_or_no_cgroup_leaves_the_cores_it_is_pinned_to(tmp_path):
    proc = fake_proc(tmp_path, "", "")
    assert allowed_cores(proc) == len(os.sched_getaffinity(0))
    assert allowed_cores(str(tmp_path / "absent")) == len(os.sched_getaffinity(0))
    assert [quota_cores(q, p) for q, p in (("-1", "100000"), ("max", "100000"), ("0", "1"),
                                            ("x", "1"), ("nan", "1"), ("5000", "10000"))] \
        == [None, None, None, None, None, 0.5]


def test_a_group_outside_the_namespace_is_not_read_and_emulate_finds_the_same_group(tmp_path):
    mounts = V1_MOUNTS.format(mount=tmp_path / "cpu")
    assert cpu_group_dirs(mounts, "2:cpu,cpuacct:/../other\n") == []
    # hvd_balance.emulate finds the controller on its own (it imports the standard library
    # only): on cgroup v1 both take this process's group under the same mount.
    from hvd_balance.tools import emulate
    own = tmp_path / "cpu" / "hvd_balance.7" / "rank1"
    own.mkdir(parents=True)
    files = [tmp_path / "mountinfo", tmp_path / "cgroup"]
    files[0].write_text(mounts)
    files[1].write_text("2:cpu,cpuacct:/hvd_balance.7/rank1\n0::/\n")
    found = emulate.find_cpu_controller(*map(str, files))
    assert (found.version, found.parent) == cpu_group_dirs(*(f.read_text() for f in files))[0]
    assert found.parent == str(own)

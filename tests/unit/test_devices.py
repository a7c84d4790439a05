"""Device pinning: the mapping from specs to devices (injected GPU lists), hosts, and tf.config."""
import os
import subprocess
import sys
import textwrap

import pytest

from hvd_balance.core import devices
from hvd_balance.core.devices import (DeviceAssignment, assign_devices, local_rank_and_size, parse_host_specs,
                                      read_hostfile, resolve_spec)
from hvd_balance.keras import pinning
from hvd_balance.keras.pinning import pin_devices


def labels(spec, local_size, n_gpus, cpu_count, **kw):
    return [a.label for a in assign_devices(spec, local_size, n_gpus, cpu_count, **kw)]


@pytest.mark.timeout(30)
def test_listed_devices_in_local_rank_order():
    out = assign_devices("gpu,gpu,cpu", 3, n_gpus=2, cpu_count=16, gpu_names=["NVIDIA A100", "Tesla T4"])
    assert [(a.kind, a.gpu_index) for a in out] == [("gpu", 0), ("gpu", 1), ("cpu", None)]
    assert [a.label for a in out] == ["gpu:0 (NVIDIA A100)", "gpu:1 (Tesla T4)", "cpu (12 threads)"]
    assert [a.intra_op_threads for a in out] == [2, 2, 12]  # 16 cores - 2 per GPU rank
    assert [a.inter_op_threads for a in out] == [1, 1, 2]
    assert [a.local_rank for a in out] == [0, 1, 2]


@pytest.mark.timeout(30)
def test_auto_with_no_gpu_puts_every_rank_on_the_cpu():
    out = assign_devices("auto", 3, n_gpus=0, cpu_count=8)
    assert [a.kind for a in out] == ["cpu"] * 3
    assert [a.intra_op_threads for a in out] == [3, 3, 2]  # 8 cores shared out, remainder first
    assert sum(a.intra_op_threads for a in out) == 8


@pytest.mark.timeout(30)
@pytest.mark.parametrize("local_size, n_gpus, expected", [
    (3, 1, ["gpu:0", "cpu (3 threads)", "cpu (3 threads)"]),
    (2, 4, ["gpu:0", "gpu:1"]),
    (4, 4, ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]),
    (1, 0, ["cpu (8 threads)"]),
])
def test_auto_one_rank_per_gpu_rest_on_cpu(local_size, n_gpus, expected):
    assert labels("auto", local_size, n_gpus, 8) == expected


@pytest.mark.timeout(30)
def test_gpu_only_host_keeps_tensorflow_thread_defaults():
    out = assign_devices("gpu*2", 2, n_gpus=2, cpu_count=32)
    assert [(a.intra_op_threads, a.inter_op_threads) for a in out] == [(None, None), (None, None)]


@pytest.mark.timeout(30)
def test_repeat_counts_and_explicit_indices():
    assert labels("gpu*3,cpu", 4, 3, 10) == ["gpu:0", "gpu:1", "gpu:2", "cpu (4 threads)"]
    assert labels("gpu:2, GPU , gpu:0", 3, 3, 4) == ["gpu:2", "gpu:1", "gpu:0"]
    assert labels("cpu*2", 2, 0, 5) == ["cpu (3 threads)", "cpu (2 threads)"]


@pytest.mark.timeout(30)
def test_cpu_ranks_get_at_least_one_thread():
    assert labels("gpu*4,cpu*2", 6, 4, 4) == ["gpu:0", "gpu:1", "gpu:2", "gpu:3", "cpu (1 thread)", "cpu (1 thread)"]
    out = assign_devices("gpu,cpu", 2, 1, 6, cores_per_gpu_rank=0)
    assert [a.intra_op_threads for a in out] == [None, 6]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec, local_size, n_gpus, message", [
    ("gpu,tpu", 2, 1, "device spec entry 2 'tpu' is not a device"),
    ("gpu,,cpu", 3, 1, "device spec entry 2 '' is not a device"),
    ("", 1, 0, "device spec is empty"),
    ("auto,cpu", 2, 0, "'auto' stands alone"),
    ("cpu:1", 1, 0, "entry 1 'cpu:1': a CPU rank takes no index"),
    ("gpu*0", 1, 1, "entry 1 'gpu*0': the count must be >= 1"),
    ("gpu:1*2", 2, 2, "one GPU index cannot be repeated"),
    ("gpu,cpu", 3, 1, "device spec 'gpu,cpu' names 2 devices but this host runs 3 ranks (local size 3)"),
    ("gpu,gpu", 2, 1, "puts local rank 1 on gpu:1 but 1 GPU is visible"),
    ("gpu", 1, 0, "puts local rank 0 on gpu:0 but 0 GPUs are visible"),
    ("gpu:0,gpu:0", 2, 2, "gives gpu:0 to local ranks 0 and 1"),
    ("gpu:3", 1, 2, "puts local rank 0 on gpu:3 but 2 GPUs are visible"),
])
def test_bad_specs_name_the_entry(spec, local_size, n_gpus, message):
    with pytest.raises(ValueError) as err:
        assign_devices(spec, local_size, n_gpus, 8)
    assert message in str(err.value)


@pytest.mark.timeout(30)
def test_per_host_specs_are_picked_by_name():
    env = {"HVD_BALANCE_DEVICES": "node1=gpu*2,cpu; node2=cpu*2 ;*=auto"}
    assert resolve_spec(env=env, names=["node1"]) == ("gpu*2,cpu", "HVD_BALANCE_DEVICES")
    assert resolve_spec(env=env, names=["node2.cluster", "node2"]) == ("cpu*2", "HVD_BALANCE_DEVICES")
    assert resolve_spec(env=env, names=["other"])[0] == "auto"
    with pytest.raises(ValueError) as err:
        resolve_spec(env={"HVD_BALANCE_DEVICES": "node1=cpu;node2=cpu"}, names=["node3", "node3.x"])
    assert ("HVD_BALANCE_DEVICES has no entry for this host (known here as 'node3', 'node3.x'); "
            "it names 'node1', 'node2'") in str(err.value)


@pytest.mark.timeout(30)
def test_spec_sources_in_order(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2 devices=gpu,cpu\nnode2 slots=1\n")
    assert resolve_spec("cpu", env={"HVD_BALANCE_DEVICES": "gpu"}) == ("cpu", "device spec")
    assert resolve_spec(env={"HVD_BALANCE_DEVICES": "gpu", "HVD_BALANCE_DEVICES_FILE": str(hostfile)})[0] == "gpu"
    file_env = {"HVD_BALANCE_DEVICES_FILE": str(hostfile), "HOROVOD_HOSTNAME": "node1"}
    assert resolve_spec(env=file_env) == ("gpu,cpu", f"hostfile {str(hostfile)!r}")
    assert resolve_spec(env=file_env, names=["node2"])[0] == "auto"
    assert resolve_spec(env={}) == ("auto", "default")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text, message", [
    ("node1=cpu;node1=gpu", "names host 'node1' twice"),
    ("=cpu", "'=cpu' is not 'host=spec'"),
    ("node1=cpu;node2=tpu", "HVD_BALANCE_DEVICES for host 'node2' entry 1 'tpu' is not a device"),
])
def test_bad_host_mappings(text, message):
    with pytest.raises(ValueError) as err:
        parse_host_specs(text)
    assert message in str(err.value)


@pytest.mark.timeout(30)
def test_hostfile_lines(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(textwrap.dedent("""\
        # host   ranks    devices
        node1    slots=4  devices=gpu,gpu,gpu,cpu
        node2    devices=cpu*2     # slots from the devices

        node3    slots=5
        node4
    """))
    got = [(e.host, e.slots, e.devices, e.line) for e in read_hostfile(str(path))]
    assert got == [("node1", 4, "gpu,gpu,gpu,cpu", 2), ("node2", 2, "cpu*2", 3), ("node3", 5, "auto", 5),
                   ("node4", 1, "auto", 6)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text, message", [
    ("node1 slots=4 devices=gpu,cpu\n", "line 1: node1 has slots=4 but devices=gpu,cpu names 2 devices"),
    ("node1 gpus=4\n", "line 1: unknown field 'gpus=4'; use slots=N and devices=SPEC"),
    ("node1 slots=2\nnode1 slots=1\n", "line 2: host 'node1' is already on line 1"),
    ("node1 slots=two\n", "line 1: slots must be an integer >= 1; got 'two'"),
    ("node1 slots=0\n", "line 1: slots must be an integer >= 1; got '0'"),
    ("node1:4\n", "line 1: 'node1:4' is not a host name"),
    ("node1 devices=gpu,tpu\n", "line 1 devices= entry 2 'tpu' is not a device"),
    ("# only a comment\n", "names no host"),
])
def test_bad_hostfiles_name_the_line(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        read_hostfile(str(path))
    assert f"hostfile {str(path)!r}" in str(err.value) and message in str(err.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("env, expected", [
    ({"HOROVOD_LOCAL_RANK": "2", "HOROVOD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, (2, 4)),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, (1, 3)),
    ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (0, 2)),
    ({"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2),2", "SLURM_NODEID": "1"}, (1, 4)),
    ({"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2),2", "SLURM_NODEID": "2"}, (1, 2)),
    ({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "3", "SLURM_NODEID": "0"}, (0, 3)),
    ({}, (0, 1)),
])
def test_local_rank_and_size_from_launchers(env, expected):
    assert local_rank_and_size(env) == expected


@pytest.mark.timeout(30)
def test_inconsistent_launcher_variables_are_refused():
    with pytest.raises(ValueError, match="HOROVOD_LOCAL_RANK/HOROVOD_LOCAL_SIZE: local rank 4 is not within local size 4"):
        local_rank_and_size({"HOROVOD_LOCAL_RANK": "4", "HOROVOD_LOCAL_SIZE": "4"})


class FakeConfig:
    """A stand-in for tf.config that records what pin_devices asks of it."""

    def __init__(self, initialised=False):
        self.calls = []
        self.initialised = initialised
        outer = self

        class Threading:
            intra = inter = 0

            def get_intra_op_parallelism_threads(self):
                return self.intra

            def get_inter_op_parallelism_threads(self):
                return self.inter

            def set_intra_op_parallelism_threads(self, n):
                outer._guard()
                self.intra = n
                outer.calls.append(("intra", n))

            def set_inter_op_parallelism_threads(self, n):
                outer._guard()
                self.inter = n
                outer.calls.append(("inter", n))

        class Experimental:
            def set_memory_growth(self, gpu, on):
                outer.calls.append(("growth", gpu, on))

            def get_device_details(self, gpu):
                return {"device_name": {"G0": "NVIDIA A100", "G1": "Tesla T4"}[gpu]}

        self.threading = Threading()
        self.experimental = Experimental()

    def _guard(self):
        if self.initialised:
            raise RuntimeError("Visible devices cannot be modified after being initialized")

    def list_physical_devices(self, kind):
        return ["G0", "G1"]

    def set_visible_devices(self, devs, kind):
        self._guard()
        self.calls.append(("visible", list(devs), kind))


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(pinning, "_current", None)
    for var in ("HVD_BALANCE_DEVICES", "HVD_BALANCE_DEVICES_FILE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.timeout(30)
def test_pin_gpu_rank_sees_only_its_gpu(fresh):
    config = FakeConfig()
    got = pin_devices("gpu,gpu,cpu", local_rank=1, local_size=3, cpu_count=8, config=config)
    assert got == DeviceAssignment(1, "gpu", 1, "Tesla T4", 2, 1)
    assert got.label == "gpu:1 (Tesla T4)"
    assert config.calls == [("visible", ["G1"], "GPU"), ("growth", "G1", True), ("intra", 2), ("inter", 1)]
    assert pinning.current_device() == got and pinning.device_label() == "gpu:1 (Tesla T4)"


@pytest.mark.timeout(30)
def test_pin_cpu_rank_hides_the_gpus_and_sizes_threads(fresh):
    config = FakeConfig()
    fresh.setenv("HVD_BALANCE_DEVICES", "gpu,gpu,cpu")
    fresh.setenv("HOROVOD_LOCAL_RANK", "2")
    fresh.setenv("HOROVOD_LOCAL_SIZE", "3")
    got = pin_devices(cpu_count=12, config=config)
    assert got.label == "cpu (8 threads)"
    assert config.calls == [("visible", [], "GPU"), ("intra", 8), ("inter", 2)]
    assert pin_devices(cpu_count=12, config=config) == got  # the same again: nothing more asked
    assert len(config.calls) == 3


@pytest.mark.timeout(30)
def test_pin_with_an_injected_gpu_list_and_the_host_mapping(fresh):
    config = FakeConfig()
    fresh.setenv("HVD_BALANCE_DEVICES", "elsewhere=cpu;thishost=auto")
    fresh.setenv("HOROVOD_HOSTNAME", "thishost")
    got = pin_devices(local_rank=0, local_size=2, gpus=["G1"], cpu_count=4, config=config)
    assert got.label == "gpu:0 (Tesla T4)" and config.calls[0] == ("visible", ["G1"], "GPU")


@pytest.mark.timeout(30)
def test_pin_after_tensorflow_started_says_so(fresh):
    with pytest.raises(RuntimeError, match=r"pin_devices\(\) must run before TensorFlow initialises its devices"):
        pin_devices("cpu", local_rank=0, local_size=1, cpu_count=2, config=FakeConfig(initialised=True))
    assert pinning.current_device() is None


@pytest.mark.timeout(30)
def test_pin_bad_spec_from_the_environment_names_the_variable(fresh):
    fresh.setenv("HVD_BALANCE_DEVICES", "gpu,npu")
    with pytest.raises(ValueError, match="HVD_BALANCE_DEVICES entry 2 'npu' is not a device"):
        pin_devices(local_rank=0, local_size=2, config=FakeConfig())


@pytest.mark.timeout(120)
def test_pin_with_real_tensorflow_and_no_gpu():
    code = textwrap.dedent("""
        import tensorflow as tf
        from hvd_balance.keras.pinning import pin_devices
        a = pin_devices("auto", cpu_count=6)
        t = tf.config.threading
        print(a.label, a.kind, t.get_intra_op_parallelism_threads(), t.get_inter_op_parallelism_threads(),
              len(tf.config.get_visible_devices("GPU")))
        print(float(tf.reduce_sum(tf.ones([3]))))
    """)
    env = dict(os.environ, HOROVOD_LOCAL_RANK="1", HOROVOD_LOCAL_SIZE="2", CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("HVD_BALANCE_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["cpu (3 threads) cpu 3 1 0", "3.0"]

"""A cluster of hosts on one machine: network namespaces, a bridge, sshd, shaped links.

Each host is a network namespace ``hbc-<run id>-<k>`` with its own address on a private
/24 (``10.231.<x>.<k+1>``), its own host name (a UTS namespace), its own ``/etc/hosts``
(``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``) and its
own ``sshd`` that lets root in with a key made for the run. The hosts' veth links end on a
bridge in a switch namespace ``hbc-<run id>-sw``, so nothing is added to the machine's own
network. ``horovodrun -H hostA:2,hostB:2`` started on host 0 then reaches host 1 through ssh
and Gloo talks TCP between the namespaces, as on a real cluster; the hosts share the file
system, so the ranks find the same Python and repository.

Optional per host: a CPU share (a cgroup quota through :class:`hvd_balance.tools.emulate.
CpuQuotaGroups`, on the host's sshd, so every process started on the host is inside it) and a
link (``tc netem`` rate and delay, both directions of the host's veth).

Everything a run makes carries its run id (namespaces ``hbc-<id>-*``, ``/etc/netns/hbc-<id>-*``,
the cgroup ``hvd_balance.cluster-<id>``, the work folder ``<tmp>/hbc-<id>-*`` with the keys),
so :func:`teardown` finds and removes a run's leftovers by name even after its owner was
killed, and :func:`teardown_stale` those of every run whose owner process is gone.

Command line (root)::

    python -m hvd_balance.tools.netns_cluster up --hosts hostA,hostB --link hostB=1gbit
    python -m hvd_balance.tools.netns_cluster teardown --stale     # or --run-id ID, --all
    python -m hvd_balance.tools.netns_cluster list
    python -m hvd_balance.tools.netns_cluster exec --run-id ID hostA -- python -m \\
        hvd_balance.bench --smoke --hosts hostA:1,hostB:1
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hvd_balance.tools import emulate

PREFIX = "hbc-"                   # namespaces and work folders: hbc-<run id>-...
CGROUP_PREFIX = "hvd_balance.cluster-"
NETNS_ETC = "/etc/netns"
SUBNET_BASE = "10.231.0.0/16"     # each run takes one free /24 of it
SSHD = "/usr/sbin/sshd"
OWNER_FILE = "owner.json"
_RUN_ID = re.compile(r"^[0-9a-f]{8}$")
_HOST_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,30}$")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$", re.IGNORECASE)
# Variables that describe the caller's session, not the job: never forwarded through ssh.
_SESSION_VARS = {"HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "_", "TERM",
                 "HOSTNAME", "MAIL", "DISPLAY", "TMUX", "SSH_AUTH_SOCK"}
_SSH_READY_S = 20.0


class ClusterError(RuntimeError):
    """The cluster cannot be made or removed; the message names the host, command or value."""


@dataclasses.dataclass(frozen=True)
class Link:
    """A host's link to the switch, shaped in both directions with ``tc netem``.

    Attributes:
        rate: bandwidth as tc writes it (``"1gbit"``, ``"100mbit"``), or None for unlimited.
        delay_ms: one-way delay added in each direction, in milliseconds (a round trip gets
            twice this).
    """

    rate: Optional[str] = None
    delay_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "Link":
        """``"1gbit/2ms"``, ``"1gbit"`` or ``"2ms"`` -> `Link`."""
        rate, delay_ms = None, 0.0
        for part in filter(None, text.split("/")):
            if part.lower().endswith("ms") and _is_number(part[:-2]):
                delay_ms = float(part[:-2])
            elif _RATE.match(part):
                rate = part.lower()
            else:
                raise ClusterError(f"link {text!r}: {part!r} is neither a rate (1gbit) nor "
                                   "a delay (2ms)")
        if not 0 <= delay_ms <= 10_000:
            raise ClusterError(f"link {text!r}: delay {delay_ms} ms outside 0..10000")
        return cls(rate, delay_ms)

    def rate_bits_per_s(self) -> Optional[float]:
        """The rate in bits/s, or None when unlimited."""
        if not self.rate:
            return None
        number, unit = re.match(r"^([\d.]+)([a-z]+)$", self.rate).groups()
        return float(number) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[unit]

    def qdisc_args(self) -> List[str]:
        """``tc qdisc add ... root`` arguments: ``netem`` when there is a delay (its rate
        too), else a token bucket (``tbf``), which every kernel has."""
        if self.delay_ms:
            args = ["netem", "delay", f"{self.delay_ms:g}ms", "limit", "100000"]
            return args + (["rate", self.rate] if self.rate else [])
        # The bucket holds at least 4 ms of the rate and two 64 KiB segments (veths pass
        # segmentation-offloaded packets that large); a queue of 50 ms.
        burst = max(int(self.rate_bits_per_s() / 8 * 0.004), 2 * 65536)
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms"]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclasses.dataclass
class Host:
    """One host of the cluster.

    Attributes:
        name: its host name (resolvable on every host, and what ``hostname`` prints there).
        namespace: its network namespace.
        address: its IPv4 address.
        cpu_share: its CPU quota in cores, or None for no quota.
        link: its link's shaping, or None for an unshaped veth.
        sshd_pid: the pid of its sshd once started.
    """

    name: str
    namespace: str
    address: str
    cpu_share: Optional[float] = None
    link: Optional[Link] = None
    sshd_pid: Optional[int] = None


def _run(cmd: Sequence[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, **kwargs)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{shlex.join(cmd)}` failed ({proc.returncode}): "
                           f"{proc.stdout.strip()}")
    return proc


def missing_requirements() -> List[str]:
    """What this machine lacks to make a cluster (empty when it can): root, ``ip``, ``tc``,
    ``sshd``, ``ssh``, ``ssh-keygen``, ``unshare``, ``nsenter``."""
    missing = [] if os.geteuid() == 0 else ["root"]
    for tool in ("ip", "tc", "ssh", "ssh-keygen", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            missing.append(tool)
    if not os.access(SSHD, os.X_OK):
        missing.append(SSHD + " (apt-get install openssh-server; scripts/cluster/install.sh)")
    return missing


def list_namespaces() -> List[str]:
    """The names of this machine's network namespaces."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _used_subnets() -> set:
    """The /24s of 10.231.0.0/16 in use: by the machine's own addresses and routes, and by
    clusters on it (their work folders record their subnet)."""
    used = set()
    base = ipaddress.ip_network(SUBNET_BASE)
    text = _run(["ip", "-4", "-o", "addr"]).stdout + _run(["ip", "-4", "route"]).stdout
    for token in re.findall(r"\d+\.\d+\.\d+\.\d+(?:/\d+)?", text):
        net = ipaddress.ip_network(token, strict=False)
        if net.overlaps(base):
            used.add(int(net.network_address.packed[2]) if net.prefixlen >= 24 else -1)
    for _, owner in _owner_records():
        used.add(owner.get("subnet_octet"))
    return used


def _owner_records(run_id: Optional[str] = None) -> List[Tuple[str, dict]]:
    """``(work dir, owner record)`` of every readable record (of run ``run_id``, or all)."""
    records = []
    for path in _work_dirs(run_id):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                records.append((path, json.load(f)))
        except (OSError, ValueError):
            pass
    return records


def _work_dirs(run_id: Optional[str] = None) -> List[str]:
    tmp = tempfile.gettempdir()
    prefix = PREFIX + (f"{run_id}-" if run_id else "")
    return [os.path.join(tmp, n) for n in sorted(os.listdir(tmp))
            if n.startswith(prefix) and os.path.isdir(os.path.join(tmp, n))]


class NetnsCluster:
    """N hosts in network namespaces with sshd, joined by a bridge; a context manager.

    Args:
        hosts: host names, e.g. ``["hostA", "hostB"]`` (letters, digits, ``-``).
        cpu_shares: None (default), or per host its CPU quota in cores (None: no quota).
        links: None (default), or ``{host name: Link}`` for the hosts whose link is shaped.
        run_id: None (default: a new one), 8 hex digits naming everything the run makes.

    Entering removes stale clusters of dead owners, then makes the namespaces, bridge,
    veths, keys, ``/etc/hosts`` files, quotas and sshds, and waits until every host answers
    ssh; a failure part way removes what was made. Leaving (also after an exception) removes
    everything: :func:`teardown` by the run id.

    Example:
        >>> with NetnsCluster(["hostA", "hostB"], links={"hostB": Link("1gbit", 2)}) as c:
        ...     c.run("hostA", ["horovodrun", "-np", "4", "-H", "hostA:2,hostB:2",
        ...                     "python", "train.py"], env={"PYTHONPATH": "/repo"})
    """

    def __init__(self, hosts: Sequence[str], cpu_shares: Optional[Sequence[Optional[float]]] = None,
                 links: Optional[Mapping[str, Link]] = None, run_id: Optional[str] = None):
        hosts = list(hosts)
        if not hosts:
            raise ClusterError("no hosts given")
        for name in hosts:
            if not _HOST_NAME.match(name) or name == "localhost":
                raise ClusterError(f"host name {name!r} must be a letter then letters, digits "
                                   "or '-', at most 31, and not localhost")
        if len(set(hosts)) != len(hosts):
            raise ClusterError(f"host names {hosts} repeat")
        if len(hosts) > 250:
            raise ClusterError(f"{len(hosts)} hosts: at most 250")
        if cpu_shares is not None and len(cpu_shares) != len(hosts):
            raise ClusterError(f"{len(cpu_shares)} CPU shares for {len(hosts)} hosts")
        unknown = sorted(set(links or {}) - set(hosts))
        if unknown:
            raise ClusterError(f"links for unknown hosts {unknown}; hosts are {hosts}")
        self.run_id = run_id or uuid.uuid4().hex[:8]
        if not _RUN_ID.match(self.run_id):
            raise ClusterError(f"run id {self.run_id!r} must be 8 hex digits")
        self.hosts: List[Host] = [
            Host(name, f"{PREFIX}{self.run_id}-{k}", "",
                 None if cpu_shares is None else cpu_shares[k], (links or {}).get(name))
            for k, name in enumerate(hosts)]
        self.switch = f"{PREFIX}{self.run_id}-sw"
        self.workdir: Optional[str] = None
        self._groups: Optional[emulate.CpuQuotaGroups] = None
        self._sshd: Dict[str, subprocess.Popen] = {}

    # -- set up ---------------------------------------------------------------------------

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> "NetnsCluster":
        """Makes the cluster (see the class); raises `ClusterError`, leaving nothing."""
        missing = missing_requirements()
        if missing:
            raise ClusterError(f"cannot make a cluster here: missing {', '.join(missing)}")
        teardown_stale()
        try:
            self._make_workdir()
            self._make_network()
            self._make_ssh()
            self._start_sshds()
        except BaseException:
            self.stop()
            raise
        return self

    def _make_workdir(self) -> None:
        used = _used_subnets()
        free = [x for x in range(10, 250) if x not in used]
        if not free:
            raise ClusterError(f"no free /24 left in {SUBNET_BASE}")
        self.subnet_octet = free[int(self.run_id, 16) % len(free)]
        for k, host in enumerate(self.hosts):
            host.address = f"10.231.{self.subnet_octet}.{k + 1}"
        self.workdir = tempfile.mkdtemp(prefix=f"{PREFIX}{self.run_id}-")
        with open(os.path.join(self.workdir, OWNER_FILE), "w") as f:
            json.dump({"run_id": self.run_id, "pid": os.getpid(),
                       "start": _process_start(os.getpid()),
                       "subnet_octet": self.subnet_octet,
                       "hosts": {h.name: h.address for h in self.hosts}}, f)

    def _make_network(self) -> None:
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1\tlocalhost\n" + "".join(
            f"{h.address}\t{h.name}\n" for h in self.hosts)
        for k, host in enumerate(self.hosts):
            ns = host.namespace
            _run(["ip", "netns", "add", ns])
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                f.write(hosts_file)
            with open(os.path.join(NETNS_ETC, ns, "hostname"), "w") as f:
                f.write(host.name + "\n")
            port = f"v{k}"
            # Made inside the switch with its peer already in the host: nothing ever sits in
            # the machine's own namespace, even for a moment.
            _run(["ip", "-n", self.switch, "link", "add", port, "type", "veth",
                  "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if host.link is not None:
                self.shape(host.name, host.link)

    def shape(self, host_name: str, link: Optional[Link]) -> None:
        """Gives ``host_name``'s link ``link`` in both directions (None: unshaped)."""
        k, host = self._index(host_name)
        for ns, dev in ((host.namespace, "eth0"), (self.switch, f"v{k}")):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            if link is not None and (link.rate or link.delay_ms):
                proc = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root",
                             *link.qdisc_args()], check=False)
                if proc.returncode != 0:
                    hint = (" (this kernel has no netem qdisc, sch_netem: a delay cannot be "
                            "added here, a rate can)" if link.delay_ms and "unknown" in
                            proc.stdout else "")
                    raise ClusterError(f"cannot shape host {host_name}'s link to {link}: "
                                       f"{proc.stdout.strip()}{hint}")
        host.link = link

    def set_link_up(self, host_name: str, up: bool) -> None:
        """Cuts (``up=False``) or restores ``host_name``'s link, at its switch port."""
        k, _ = self._index(host_name)
        _run(["ip", "-n", self.switch, "link", "set", f"v{k}", "up" if up else "down"])

    def _make_ssh(self) -> None:
        wd = self.workdir
        for key in ("id_ed25519", "ssh_host_ed25519_key"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hbc-{self.run_id}",
                  "-f", os.path.join(wd, key)])
        shutil.copy(os.path.join(wd, "id_ed25519.pub"), os.path.join(wd, "authorized_keys"))
        with open(os.path.join(wd, "ssh_host_ed25519_key.pub")) as f:
            host_key = " ".join(f.read().split()[:2])
        with open(os.path.join(wd, "known_hosts"), "w") as f:
            for h in self.hosts:
                f.write(f"{h.name},{h.address} {host_key}\n")
        with open(self.ssh_config, "w") as f:
            f.write(f"Host *\n  User root\n  IdentityFile {wd}/id_ed25519\n"
                    f"  IdentitiesOnly yes\n  UserKnownHostsFile {wd}/known_hosts\n"
                    "  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n"
                    "  BatchMode yes\n  LogLevel ERROR\n  ConnectTimeout 10\n"
                    "  ServerAliveInterval 5\n  ServerAliveCountMax 3\n")
        # horovodrun runs `ssh -o ... host cmd` through the shell: this `ssh` first on PATH
        # makes it use the run's key, known hosts and config, and leaves ~/.ssh alone.
        os.makedirs(self.bin_dir)
        ssh = os.path.join(self.bin_dir, "ssh")
        with open(ssh, "w") as f:
            f.write(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {self.ssh_config} \"$@\"\n")
        os.chmod(ssh, 0o755)
        for h in self.hosts:
            with open(os.path.join(wd, f"sshd-{h.name}.conf"), "w") as f:
                f.write(f"ListenAddress {h.address}\nPort 22\n"
                        f"HostKey {wd}/ssh_host_ed25519_key\nPidFile {wd}/sshd-{h.name}.pid\n"
                        f"AuthorizedKeysFile {wd}/authorized_keys\n"
                        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                        "PrintMotd no\nMaxStartups 200\nMaxSessions 200\nUseDNS no\n"
                        "ClientAliveInterval 5\nClientAliveCountMax 3\n")

    @property
    def ssh_config(self) -> str:
        """The run's ssh client configuration (key, known hosts)."""
        return os.path.join(self.workdir, "ssh_config")

    @property
    def bin_dir(self) -> str:
        """A folder to put first on PATH: its ``ssh`` uses the run's key and known hosts."""
        return os.path.join(self.workdir, "bin")

    def _start_sshds(self) -> None:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder
        shares = [h.cpu_share for h in self.hosts]
        if any(s is not None for s in shares):
            # One group per host; a host without a share gets a quota of every core.
            self._groups = emulate.CpuQuotaGroups(
                [s if s is not None else float(os.cpu_count()) for s in shares],
                name=f"{CGROUP_PREFIX}{self.run_id}").create()
        for k, h in enumerate(self.hosts):
            conf = os.path.join(self.workdir, f"sshd-{h.name}.conf")
            # Its own UTS namespace: `hostname` prints the host's name there and below.
            proc = subprocess.Popen(
                ["ip", "netns", "exec", h.namespace, "unshare", "--uts", "sh", "-c",
                 f"hostname {h.name} && exec {SSHD} -D -e -f {conf}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(self.workdir, f"sshd-{h.name}.log"), "w"),
                start_new_session=True)
            self._sshd[h.name] = proc
            h.sshd_pid = proc.pid
            if self._groups is not None:
                self._groups.add_process(k, proc.pid)
        deadline = time.monotonic() + _SSH_READY_S
        for h in self.hosts:
            while True:
                probe = subprocess.run(
                    self.ssh_command(self.hosts[0].name, h.name, ["hostname"]),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                if probe.returncode == 0 and probe.stdout.strip() == h.name:
                    break
                if self._sshd[h.name].poll() is not None or time.monotonic() > deadline:
                    log = open(os.path.join(self.workdir, f"sshd-{h.name}.log")).read()
                    raise ClusterError(f"host {h.name} does not answer ssh: {probe.stdout.strip()}"
                                       f"; sshd log: {log.strip()[-2000:]}")
                time.sleep(0.2)

    # -- use ------------------------------------------------------------------------------

    def _index(self, host_name: str):
        for k, h in enumerate(self.hosts):
            if h.name == host_name:
                return k, h
        raise ClusterError(f"no host {host_name!r}; hosts are {[h.name for h in self.hosts]}")

    def host(self, name: str) -> Host:
        """The `Host` called ``name``."""
        return self._index(name)[1]

    def ssh_command(self, from_host: str, to_host: str, argv: Sequence[str],
                    env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> List[str]:
        """The command that runs ``argv`` on ``to_host`` through ssh from ``from_host``
        (run it on this machine), with ``env``'s job variables set there (the caller's
        session variables are left out: `_SESSION_VARS`) and ``PATH`` led by `bin_dir`."""
        env = dict(env or {})
        env["PATH"] = os.pathsep.join([self.bin_dir, env.get("PATH") or os.environ["PATH"]])
        assigns = [f"{k}={v}" for k, v in sorted(env.items())
                   if k not in _SESSION_VARS and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k)]
        remote = (f"cd {shlex.quote(cwd or os.getcwd())} && exec env "
                  f"{shlex.join(assigns)} {shlex.join(list(argv))}")
        return ["ip", "netns", "exec", self.host(from_host).namespace,
                os.path.join(self.bin_dir, "ssh"), to_host, remote]

    def run(self, host_name: str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None, timeout: Optional[float] = None,
            ) -> subprocess.CompletedProcess:
        """Runs ``argv`` on ``host_name`` (logged in through ssh, so inside its quota and
        under its host name) and returns it finished, stdout and stderr merged."""
        return subprocess.run(self.ssh_command(host_name, host_name, argv, env, cwd),
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)

    def hostfile_hosts(self, slots: int) -> str:
        """``hostA:slots,hostB:slots``, for ``horovodrun -H``."""
        return ",".join(f"{h.name}:{slots}" for h in self.hosts)

    def describe(self) -> str:
        lines = [f"cluster {self.run_id}: switch namespace {self.switch}, work folder "
                 f"{self.workdir}"]
        for h in self.hosts:
            link = ("unshaped" if h.link is None else
                    f"{h.link.rate or 'any rate'}, {h.link.delay_ms:g} ms")
            share = "" if h.cpu_share is None else f", {h.cpu_share:g} cores"
            lines.append(f"  {h.name:<10} {h.address:<15} netns {h.namespace}, sshd "
                         f"{h.sshd_pid}, link {link}{share}")
        first = self.hosts[0]
        lines.append(f"log in: ip netns exec {first.namespace} {self.bin_dir}/ssh {first.name}")
        return "\n".join(lines)

    # -- tear down ------------------------------------------------------------------------

    def stop(self) -> None:
        """Removes everything the run made (idempotent); raises `ClusterError` naming what
        could not be removed."""
        teardown(self.run_id)
        self._groups = None
        self._sshd.clear()


def attach(run_id: str) -> NetnsCluster:
    """The running cluster ``run_id`` (made by another process, e.g. ``netns-cluster up``),
    to run commands on with `NetnsCluster.ssh_command`; it stays owned by its maker."""
    for path, owner in _owner_records(run_id):
        cluster = NetnsCluster(list(owner["hosts"]), run_id=run_id)
        cluster.workdir = path
        for host in cluster.hosts:
            host.address = owner["hosts"][host.name]
        return cluster
    raise ClusterError(f"no running cluster {run_id!r}; running: {run_ids()}")


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (field 22 of /proc/pid/stat), so that a reused
    pid is not taken for the owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def run_ids() -> List[str]:
    """The run ids of every cluster with something left on this machine (namespaces, work
    folders, /etc/netns entries or cgroups)."""
    names = list_namespaces() + [os.path.basename(p) for p in _work_dirs()]
    if os.path.isdir(NETNS_ETC):
        names += os.listdir(NETNS_ETC)
    ids = {n[len(PREFIX):len(PREFIX) + 8] for n in names if n.startswith(PREFIX)}
    for group in _cgroup_dirs():
        ids.add(os.path.basename(group)[len(CGROUP_PREFIX):])
    return sorted(i for i in ids if _RUN_ID.match(i))


def _cgroup_dirs(run_id: Optional[str] = None) -> List[str]:
    try:
        parent = emulate.find_cpu_controller().parent
    except emulate.EmulationError:
        return []
    prefix = CGROUP_PREFIX + (run_id or "")
    return [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(prefix)]


def leftovers(run_id: str) -> List[str]:
    """What run ``run_id`` still has on this machine, one description each (empty: nothing):
    namespaces, /etc/netns folders, work folders, cgroups, and processes in its namespaces."""
    found = []
    for ns in list_namespaces():
        if ns.startswith(f"{PREFIX}{run_id}-"):
            found.append(f"namespace {ns}")
            found += [f"process {pid} in {ns}" for pid in _namespace_pids(ns)]
    if os.path.isdir(NETNS_ETC):
        found += [f"{NETNS_ETC}/{n}" for n in os.listdir(NETNS_ETC)
                  if n.startswith(f"{PREFIX}{run_id}-")]
    found += [f"work folder {p}" for p in _work_dirs(run_id)]
    found += [f"cgroup {p}" for p in _cgroup_dirs(run_id)]
    return found


def _namespace_pids(ns: str) -> List[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def teardown(run_id: str, timeout_s: float = 15.0) -> None:
    """Removes everything of run ``run_id``, found by name: kills the processes in its
    namespaces (sshds, ranks, drivers) and its cgroup, deletes the namespaces (their veths
    and the bridge go with them), the /etc/netns folders, the work folder with the keys.

    Raises:
        ClusterError: something could not be removed; every item is named.
    """
    if not _RUN_ID.match(run_id):
        raise ClusterError(f"run id {run_id!r} must be 8 hex digits")
    problems = []
    namespaces = [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}{run_id}-")]
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [pid for ns in namespaces for pid in _namespace_pids(ns)]
        if not pids:
            break
        if time.monotonic() > deadline:
            problems.append(f"processes {pids} survive SIGKILL")
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for group in _cgroup_dirs(run_id):
        try:
            emulate.remove_group_tree(group)
        except emulate.EmulationError as e:
            problems.append(str(e))
    for ns in namespaces:
        proc = _run(["ip", "netns", "del", ns], check=False)
        if proc.returncode != 0 and ns in list_namespaces():
            problems.append(f"namespace {ns}: {proc.stdout.strip()}")
    if os.path.isdir(NETNS_ETC):
        for name in os.listdir(NETNS_ETC):
            if name.startswith(f"{PREFIX}{run_id}-"):
                shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    for path in _work_dirs(run_id):
        shutil.rmtree(path, ignore_errors=True)
    left = leftovers(run_id)
    if problems or left:
        raise ClusterError(f"cluster {run_id} not fully removed: {'; '.join(problems + left)}")


def owner_alive(run_id: str) -> bool:
    """Whether the process that made run ``run_id`` still runs (False without a record)."""
    for _, owner in _owner_records(run_id):
        return owner.get("start") is not None and _process_start(owner["pid"]) == owner["start"]
    return False


def teardown_stale() -> List[str]:
    """Tears down every run whose owner is gone (killed, even by SIGKILL); returns their ids."""
    stale = [r for r in run_ids() if not owner_alive(r)]
    for run_id in stale:
        teardown(run_id)
    return stale


# -- command line ---------------------------------------------------------------------------

def _parse_links(specs: Sequence[str]) -> Dict[str, Link]:
    links = {}
    for spec in specs:
        host, sep, link = spec.partition("=")
        if not sep:
            raise ClusterError(f"--link {spec!r}: write HOST=RATE/DELAY, e.g. hostB=1gbit/2ms")
        links[host] = Link.parse(link)
    return links


def _parse_shares(text: Optional[str], n: int) -> Optional[List[Optional[float]]]:
    if not text:
        return None
    shares = [None if s.strip() in ("", "-") else float(s) for s in text.split(",")]
    if len(shares) != n:
        raise ClusterError(f"--cpu-shares {text!r}: {len(shares)} values for {n} hosts")
    return shares


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="netns-cluster", description="A cluster of ssh hosts in network namespaces on "
        "this machine (root).")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make a cluster and keep it until SIGINT/SIGTERM")
    up.add_argument("--hosts", default="hostA,hostB", help="host names (default hostA,hostB)")
    up.add_argument("--cpu-shares", help="per host CPU cores, e.g. 1.0,0.5 ('-': no quota; write --cpu-shares=-,0.5)")
    up.add_argument("--link", action="append", default=[], metavar="HOST=RATE/DELAY",
                    help="shape a host's link, e.g. hostB=1gbit/2ms (repeatable)")
    up.add_argument("--run-id", help="8 hex digits (default: a new one)")
    up.add_argument("--for-seconds", type=float, help="tear down after this long")
    down = sub.add_parser("teardown", help="remove clusters' leftovers by run id")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-id")
    which.add_argument("--stale", action="store_true", help="runs whose owner is gone")
    which.add_argument("--all", action="store_true", help="every run, owners alive or not")
    sub.add_parser("list", help="the run ids with something left, and what")
    hosts = sub.add_parser("hosts", help="a running cluster's hosts, a line each: name, "
                           "address, network namespace")
    hosts.add_argument("--run-id", required=True)
    run = sub.add_parser("exec", help="run a command on a host of a running cluster, through "
                         "ssh from the repository, with this environment's variables")
    run.add_argument("--run-id", required=True)
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    args = parser.parse_args(argv)
    try:
        if args.command == "exec":
            argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not argv:
                raise ClusterError("exec: no command given after the host")
            cluster = attach(args.run_id)
            return subprocess.call(cluster.ssh_command(args.host, args.host, argv, os.environ))
        if args.command == "hosts":
            for host in attach(args.run_id).hosts:
                print(host.name, host.address, host.namespace)
            return 0
        if args.command == "list":
            for run_id in run_ids():
                state = "owner alive" if owner_alive(run_id) else "stale"
                print(f"{run_id} ({state}): {', '.join(leftovers(run_id))}")
            return 0
        if args.command == "teardown":
            ids = ([args.run_id] if args.run_id else run_ids() if args.all else None)
            if ids is None:
                ids = teardown_stale()
            else:
                for run_id in ids:
                    teardown(run_id)
            print(f"removed {len(ids)} cluster(s): {' '.join(ids)}")
            return 0
        hosts = [h for h in args.hosts.split(",") if h]
        cluster = NetnsCluster(hosts, _parse_shares(args.cpu_shares, len(hosts)),
                               _parse_links(args.link), args.run_id)
    except (ClusterError, ValueError) as e:
        print(f"netns-cluster: {e}", file=sys.stderr)
        return 2
    stop = []

    def on_signal(signum, frame):
        if stop:  # already tearing down: a second signal must not interrupt it
            return
        stop.append(signum)
        raise KeyboardInterrupt
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        with cluster:
            print(cluster.describe(), flush=True)
            print("ready", flush=True)
            end = None if args.for_seconds is None else time.monotonic() + args.for_seconds
            while end is None or time.monotonic() < end:
                time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    except ClusterError as e:
        print(f"netns-cluster: {e}", file=sys.stderr)
        return 2
    print(f"cluster {cluster.run_id} removed", flush=True)
    return 128 + stop[0] if stop else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# A real SLURM on this machine (root): munge, slurmctld and slurmd with a configuration of
# their own in $HVD_BALANCE_SLURM_DIR (default /tmp/hvd_balance-slurm), nothing in /etc/slurm.
#
# One node: this machine under its host name, with its cores.
#
#   bash scripts/cluster/slurm.sh start     # installs slurmd, slurmctld, munge if missing
#   SLURM_CONF=/tmp/hvd_balance-slurm/slurm.conf sbatch --wait ... scripts/slurm/hvd_balance.sbatch python ...
#   bash scripts/cluster/slurm.sh stop      # stops the daemons it started, removes the folder
#
# Or one node per host of a running namespace cluster (scripts/cluster/netns-cluster up; its
# hosts are read with `netns-cluster hosts` run by $HVD_BALANCE_PYTHON, default the
# repository's .venv, else python3):
#
#   bash scripts/cluster/slurm.sh start --netns RUN_ID     # (or HVD_BALANCE_SLURM_NETNS=RUN_ID)
#   SLURM_CONF=/tmp/hvd_balance-slurm/slurm.conf scripts/cluster/netns-cluster exec --run-id RUN_ID \
#       hostA -- sbatch --wait --nodes=2 ... scripts/slurm/hvd_balance.sbatch python ...
#   bash scripts/cluster/slurm.sh stop
#
# There each host runs its own slurmd (NodeName = the host's name, NodeAddr = its address, the
# machine's cores), the first host also slurmctld, so SLURM's commands must run in a host's
# namespace (netns-cluster exec, or `ip netns exec hbc-RUN_ID-0 ...`). The daemons enter the
# host's network namespace with nsenter, not `ip netns exec` (which mounts a fresh /sys
# without the cgroup mounts slurmd needs), in a UTS and mount namespace of their own with the
# host's name and /etc/hosts, so a batch job sees the host as hosts started through its sshd
# do. One munged in the machine's namespace serves every slurmd: its socket is a file, and the
# hosts share the file system. Ports 16817 (slurmctld) / 16818 (slurmd). Tearing the
# namespace cluster down kills the daemons inside it too; `stop` still removes the folder.
set -euo pipefail
dir=${HVD_BALANCE_SLURM_DIR:-/tmp/hvd_balance-slurm}
cmd=${1:-}
netns=${HVD_BALANCE_SLURM_NETNS:-}
if [ "${2:-}" = --netns ]; then netns=${3:-}; [ -n "$netns" ] || { echo "$0: --netns RUN_ID" >&2; exit 2; }; fi

stop() {
  for f in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munged.pid"; do
    if [ -f "$f" ]; then
      pid=$(cat "$f")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$dir"
}

case "$cmd" in
  stop) stop; exit 0 ;;
  start) ;;
  *) echo "usage: $0 start [--netns RUN_ID] | stop" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "$0: needs root" >&2; exit 2; }

# The nodes: "name address namespace" lines (the namespace empty: this machine).
if [ -n "$netns" ]; then
  [[ $netns =~ ^[0-9a-f]{8}$ ]] || { echo "$0: run id '$netns' must be 8 hex digits" >&2; exit 2; }
  # netns-cluster's own answer (hvd_balance imports numpy: the stack's interpreter)
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  py=${HVD_BALANCE_PYTHON:-}
  [ -n "$py" ] || { [ -x "$repo/.venv/bin/python" ] && py=$repo/.venv/bin/python || py=python3; }
  listing=$("$py" "$repo/scripts/cluster/netns-cluster" hosts --run-id "$netns") || exit 2
  mapfile -t nodes <<< "$listing"
  for n in "${nodes[@]}"; do
    read -r _ _ ns <<< "$n"
    [ -e "/run/netns/$ns" ] || { echo "$0: namespace $ns of cluster $netns is gone" >&2; exit 2; }
  done
else
  nodes=("$(hostname) 127.0.0.1 ")
fi

need=()
for p in slurmd slurmctld munged sbatch; do command -v "$p" >/dev/null || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmd slurmctld \
    slurm-client munge >&2
fi
stop
mkdir -p "$dir"/{state,munge}
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
  chmod 400 /etc/munge/munge.key
fi
chmod 700 "$dir/munge"
munged --force --socket="$dir/munge/munge.socket" --pid-file="$dir/munged.pid" \
  --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"
cpus=$(nproc)
mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 / ${#nodes[@]}))
read -r ctl_name ctl_addr ctl_ns <<< "${nodes[0]}"
cat > "$dir/slurm.conf" <<CONF
ClusterName=hvdbalance
SlurmctldHost=$ctl_name($ctl_addr)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
CONF
for n in "${nodes[@]}"; do
  read -r name addr _ <<< "$n"
  mkdir -p "$dir/spool-$name"
  echo "NodeName=$name NodeAddr=$addr CPUs=$cpus RealMemory=$mem State=UNKNOWN" >> "$dir/slurm.conf"
done
echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" \
  >> "$dir/slurm.conf"
export SLURM_CONF=$dir/slurm.conf

# Runs a daemon on a node: here, or inside the host's network namespace under its name.
on_node() {
  local name=$1 ns=$2; shift 2
  if [ -z "$ns" ]; then "$@"; return; fi
  nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c \
    'mount --bind "/etc/netns/$1/hosts" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
    sh "$ns" "$name" "$@"
}
on_node "$ctl_name" "$ctl_ns" slurmctld -f "$SLURM_CONF" -i
for n in "${nodes[@]}"; do
  read -r name _ ns <<< "$n"
  on_node "$name" "$ns" slurmd -f "$SLURM_CONF" -N "$name"
done
client=()
[ -z "$ctl_ns" ] || client=(ip netns exec "$ctl_ns")
for _ in $(seq 150); do
  if [ "$("${client[@]}" sinfo -h -N -o %t 2>/dev/null | grep -cx idle)" = "${#nodes[@]}" ]; then
    [ -z "$ctl_ns" ] || echo "SLURM_NETNS=$ctl_ns"
    echo "SLURM_CONF=$SLURM_CONF"; exit 0
  fi
  sleep 0.2
done
echo "$0: the nodes did not become idle: $("${client[@]}" sinfo -N 2>&1)" >&2
tail -n 5 "$dir"/*.log >&2
exit 1

#!/usr/bin/env bash
# A one-node SLURM on this machine (root): munge, slurmctld and slurmd with a configuration of
# their own in $HVD_BALANCE_SLURM_DIR (default /tmp/hvd_balance-slurm), nothing in /etc/slurm.
#
#   bash scripts/cluster/slurm.sh start     # installs slurmd, slurmctld, munge if missing
#   SLURM_CONF=/tmp/hvd_balance-slurm/slurm.conf sbatch --wait ... scripts/slurm/hvd_balance.sbatch python ...
#   bash scripts/cluster/slurm.sh stop      # stops the daemons it started, removes the folder
#
# The node is this machine under its host name, with its cores; ports 16817/16818.
set -euo pipefail
dir=${HVD_BALANCE_SLURM_DIR:-/tmp/hvd_balance-slurm}
node=$(hostname)
cmd=${1:-}

stop() {
  for d in slurmd slurmctld munged; do
    if [ -f "$dir/$d.pid" ]; then
      pid=$(cat "$dir/$d.pid")
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
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "$0: needs root" >&2; exit 2; }
need=()
for p in slurmd slurmctld munged sbatch; do command -v "$p" >/dev/null || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmd slurmctld \
    slurm-client munge >&2
fi
stop
mkdir -p "$dir"/{state,spool,munge} 
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
  chmod 400 /etc/munge/munge.key
fi
chmod 700 "$dir/munge"
munged --force --socket="$dir/munge/munge.socket" --pid-file="$dir/munged.pid" \
  --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"
cpus=$(nproc)
mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))
cat > "$dir/slurm.conf" <<CONF
ClusterName=hvdbalance
SlurmctldHost=$node(127.0.0.1)
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
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF" -i
slurmd -f "$SLURM_CONF" -N "$node"
for _ in $(seq 100); do
  if sinfo -h -o %t 2>/dev/null | grep -qx idle; then
    echo "SLURM_CONF=$SLURM_CONF"; exit 0
  fi
  sleep 0.2
done
echo "$0: the node did not become idle: $(sinfo 2>&1)" >&2
tail -5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2
exit 1

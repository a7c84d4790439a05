#!/usr/bin/env bash
# What the namespace cluster (hvd_balance/tools/netns_cluster.py, tests/cluster) needs beyond
# the Python stack: sshd, ssh, iproute2 (ip, tc) and util-linux (unshare, nsenter), from apt.
# Idempotent; run as root. Prints nothing when everything is there.
set -euo pipefail
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null || need+=(openssh-client)
command -v ip >/dev/null && command -v tc >/dev/null || need+=(iproute2)
command -v unshare >/dev/null && command -v nsenter >/dev/null || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then echo "scripts/cluster/install.sh: needs root to install ${need[*]}" >&2; exit 2; fi
  echo "scripts/cluster/install.sh: installing ${need[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >&2; }
fi

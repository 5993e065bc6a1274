#!/usr/bin/env bash
# Installs a single-node Slurm (Debian's slurmctld, slurmd, slurm-client, munge) for the
# test that runs examples/cluster/slurm/polytrain.sbatch on a real Slurm
# (tests/integration/test_slurm.py). Safe to re-run; starts no daemon (the test starts
# its own, in a temporary directory). Skips, saying why, where it cannot install:
# not root, no apt-get, or SKIP_SLURM=1.
set -euo pipefail

log() { printf '\n==> %s\n' "$*"; }

if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
  && command -v sbatch >/dev/null && command -v munged >/dev/null; then
  log "Slurm already installed ($(slurmctld -V))"
  exit 0
fi
if [ "${SKIP_SLURM:-0}" = "1" ]; then
  log "SKIP_SLURM=1: not installing Slurm (its test is skipped)"
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null; then
  log "not root with apt-get: not installing Slurm (its test is skipped)"
  exit 0
fi

log "installing Slurm and munge from Debian's packages"
start=$(date +%s)
# Debian's maintainer scripts would start the daemons; there is no init system to run
# them here, and the test starts its own: refuse every service start during the install.
policy=/usr/sbin/policy-rc.d
had_policy=0
[ -e "$policy" ] && had_policy=1
if [ "$had_policy" = 0 ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod +x "$policy"
fi
trap '[ "$had_policy" = 0 ] && rm -f "$policy"' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
log "Slurm $(slurmctld -V | awk '{print $2}') installed in $(($(date +%s) - start)) s"

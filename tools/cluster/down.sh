#!/usr/bin/env bash
# down.sh — tear down the cluster made by up.sh; safe to run any number of times.
#
# Stops slurmd (one per node), slurmctld and munged by the pids in their pid files
# (checking the process name first), then any process still left inside our node
# namespaces (job steps), deletes the namespaces, veths and the bridge. Logs and
# configs under $HPCDP_CLUSTER_DIR are kept for post-mortems unless --purge.
#
# Usage: down.sh [--dir DIR] [--purge]
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
purge=0
while (($#)); do
    case $1 in
        --dir)   HPCDP_CLUSTER_DIR=${2:?--dir needs a value}; shift 2 ;;
        --dir=*) HPCDP_CLUSTER_DIR=${1#*=}; shift ;;
        --purge) purge=1; shift ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "down.sh: unknown argument: $1 (try --help)" >&2; exit 2 ;;
    esac
done
HPCDP_CLUSTER_DIR=${HPCDP_CLUSTER_DIR:-/tmp/hpcdp-cluster}
((EUID == 0)) || { echo "down.sh: must run as root" >&2; exit 1; }
# What up.sh recorded wins over the caller's environment: tear down what is really up.
if [[ -f $HPCDP_CLUSTER_DIR/cluster.env ]]; then
    # shellcheck disable=SC1091
    . "$HPCDP_CLUSTER_DIR/cluster.env"
fi
# shellcheck source=SCRIPTDIR/common.sh
. "$SCRIPT_DIR/common.sh"
export PATH=$PATH:/usr/sbin:/sbin

[[ -d $HPCDP_CLUSTER_DIR ]] || { log "nothing to do ($HPCDP_CLUSTER_DIR absent)"; exit 0; }
take_lock

# Nodes to consider: those recorded, plus any slurmd pid file / netns with our prefix.
maxn=$HPCDP_CLUSTER_NODES
for f in "$C_RUN"/slurmd-node*.pid; do
    [[ -e $f ]] || continue
    n=${f##*/slurmd-node}; n=${n%.pid}
    [[ $n =~ ^[0-9]+$ ]] && ((n > maxn)) && maxn=$n
done
for f in /run/netns/"${HPCDP_CLUSTER_NETNS_PREFIX}"node*; do
    [[ -e $f ]] || continue
    n=${f##*node}
    [[ $n =~ ^[0-9]+$ ]] && ((n > maxn)) && maxn=$n
done

# 1. slurmd per node, then whatever is left in the node's namespace (slurmstepd, tasks).
for ((i = 1; i <= maxn; i++)); do
    kill_pidfile "$C_RUN/slurmd-node$i.pid" slurmd
    ns=$(netns_of "$i")
    if [[ -e /run/netns/$ns ]]; then
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            # shellcheck disable=SC2086
            log "stopping leftover processes in $ns: $(oneline "$pids")"
            # shellcheck disable=SC2086
            kill_pids $pids
        fi
    fi
done
# 2. controller and munge.
kill_pidfile "$C_RUN/slurmctld.pid" slurmctld
kill_pidfile "$C_RUN/munged.pid" munged
rm -f "$C_MUNGE/munge.socket" "$C_MUNGE/munge.socket.lock"

# 3. network: namespaces (their eth0 dies with them, taking the host veth along), then
#    any veth left over, then the bridge.
for ((i = 1; i <= maxn; i++)); do
    ns=$(netns_of "$i")
    if [[ -e /run/netns/$ns ]]; then
        log "deleting netns $ns"
        ip netns del "$ns" || log "WARNING: could not delete netns $ns"
    fi
    ip link del "$(veth_of "$i")" >/dev/null 2>&1 || true
done
if ip link show "$HPCDP_CLUSTER_BRIDGE" >/dev/null 2>&1; then
    log "deleting bridge $HPCDP_CLUSTER_BRIDGE"
    ip link del "$HPCDP_CLUSTER_BRIDGE"
fi
rm -f "$C_ENVFILE"

if ((purge)); then
    exec 9>&-
    log "purging $HPCDP_CLUSTER_DIR"
    rm -rf "${HPCDP_CLUSTER_DIR:?}"
fi
log "down"

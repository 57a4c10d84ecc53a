#!/usr/bin/env bash
# up.sh — bring up (idempotently) a local Slurm "cluster" of N fake nodes.
#
# Each node i is a network namespace "${HPCDP_CLUSTER_NETNS_PREFIX}node$i" with its own
# UTS hostname (node$i), its own /etc/hosts (bind mount in a private mount namespace),
# and a veth "NIC" eth0 = $SUBNET.$i on a bridge; the egress of every eth0 is shaped
# with tbf, so each node has a full-duplex link of --rate to the bridge. munged and
# slurmctld run in the root namespace (bridge address $SUBNET.254), one slurmd runs in
# each node namespace. All state is under $HPCDP_CLUSTER_DIR; the system /etc/slurm
# and /etc/munge are not touched (we run our own munged with a private key and socket).
#
# Usage: up.sh [--rate 1gbit|2gbit|500mbit|none] [--nodes N] [--cpus C] [--dir DIR]
#              [--no-install] [--install-only]
# --cpus: Slurm CPUs per node (default: nproc); more than the machine has is fine (several
#         ranks per node oversubscribe the shared cores; SlurmdParameters=config_overrides).
# Env:   HPCDP_CLUSTER_DIR, HPCDP_CLUSTER_RATE, HPCDP_CLUSTER_NODES, ... (see common.sh)
# Re-running with the cluster up only re-applies what differs (e.g. a new --rate is
# applied to the qdiscs in place, without restarting Slurm).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# ---------------------------------------------------------------- arguments
install=1 install_only=0
while (($#)); do
    case $1 in
        --rate)   HPCDP_CLUSTER_RATE=${2:?--rate needs a value}; shift 2 ;;
        --rate=*) HPCDP_CLUSTER_RATE=${1#*=}; shift ;;
        --nodes)  HPCDP_CLUSTER_NODES=${2:?--nodes needs a value}; shift 2 ;;
        --nodes=*) HPCDP_CLUSTER_NODES=${1#*=}; shift ;;
        --cpus)   HPCDP_CLUSTER_CPUS=${2:?--cpus needs a value}; shift 2 ;;
        --cpus=*) HPCDP_CLUSTER_CPUS=${1#*=}; shift ;;
        --dir)    HPCDP_CLUSTER_DIR=${2:?--dir needs a value}; shift 2 ;;
        --dir=*)  HPCDP_CLUSTER_DIR=${1#*=}; shift ;;
        --no-install)   install=0; shift ;;
        --install-only) install_only=1; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "up.sh: unknown argument: $1 (try --help)" >&2; exit 2 ;;
    esac
done
export HPCDP_CLUSTER_DIR HPCDP_CLUSTER_RATE HPCDP_CLUSTER_NODES
# shellcheck source=SCRIPTDIR/common.sh
. "$SCRIPT_DIR/common.sh"

[[ $(uname -s) == Linux ]] || die "Linux only"
((EUID == 0)) || die "must run as root (network namespaces, tc, daemons)"
[[ $HPCDP_CLUSTER_NODES =~ ^[1-9][0-9]{0,2}$ ]] || die "--nodes must be 1..250, got '$HPCDP_CLUSTER_NODES'"
((HPCDP_CLUSTER_NODES <= 250)) || die "--nodes must be 1..250, got '$HPCDP_CLUSTER_NODES'"
[[ $HPCDP_CLUSTER_RATE == none || $HPCDP_CLUSTER_RATE =~ ^[0-9]+(\.[0-9]+)?[kmgt]?bit$ ]] \
    || die "--rate must be like 1gbit, 2gbit, 500mbit or none; got '$HPCDP_CLUSTER_RATE'"
[[ $HPCDP_CLUSTER_CPUS =~ ^[1-9][0-9]{0,3}$ ]] || die "--cpus must be 1..9999, got '$HPCDP_CLUSTER_CPUS'"
[[ $HPCDP_CLUSTER_SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "HPCDP_CLUSTER_SUBNET must be a /24 prefix like 10.77.0"

# ---------------------------------------------------------------- packages
# What we need from Debian, as "command-or-file:package".
need_pkgs() {
    local missing=() c
    for c in slurmctld:slurmctld slurmd:slurmd sinfo:slurm-client sbatch:slurm-client \
             munged:munge ip:iproute2 tc:iproute2 nsenter:util-linux unshare:util-linux flock:util-linux; do
        command -v "${c%%:*}" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "${c%%:*}" >/dev/null 2>&1 \
            || missing+=("${c#*:}")
    done
    # Slurm's mpi/pmix plugin dlopens the unversioned libpmix.so that only libpmix-dev ships.
    compgen -G '/usr/lib/*/pmix2/lib/libpmix.so' >/dev/null || missing+=(libpmix-dev)
    printf '%s\n' "${missing[@]}" | sort -u | grep . || true
}

install_pkgs() {
    local pkgs
    pkgs=$(need_pkgs)
    [[ -z $pkgs ]] && return 0
    command -v apt-get >/dev/null || die "missing packages ($(oneline "$pkgs")) and no apt-get to install them"
    log "installing: $(oneline "$pkgs")"
    # Keep maintainer scripts from starting system munge/slurm services (the Docker
    # convention); only if no policy is in place already, and removed afterwards.
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; own_policy=1
    fi
    local rc=0 apt=(apt-get -q -o "DPkg::Lock::Timeout=$HPCDP_CLUSTER_APT_TIMEOUT")
    export DEBIAN_FRONTEND=noninteractive
    # apt-get update once (per up.sh call, only when something is missing).
    timeout "$HPCDP_CLUSTER_APT_TIMEOUT" "${apt[@]}" update >"$C_LOG/apt.log" 2>&1 || rc=$?
    if ((rc == 0)); then
        # shellcheck disable=SC2086
        timeout "$HPCDP_CLUSTER_APT_TIMEOUT" "${apt[@]}" install -y --no-install-recommends $pkgs \
            >>"$C_LOG/apt.log" 2>&1 || rc=$?
    fi
    ((own_policy)) && rm -f "$policy"
    ((rc == 0)) || { tail -n 20 "$C_LOG/apt.log" >&2; die "apt-get failed (rc=$rc), see $C_LOG/apt.log"; }
    pkgs=$(need_pkgs)
    [[ -z $pkgs ]] || die "still missing after apt-get: $(oneline "$pkgs")"
}

mkdir -p "$HPCDP_CLUSTER_DIR" "$C_ETC" "$C_RUN" "$C_LOG" "$C_STATE" "$C_SPOOL" "$C_TMP" "$C_MUNGE" "$C_HOSTS"
take_lock   # fd 9; closed (9>&-) for every daemon we start, or they would hold the lock
if ((install)); then
    install_pkgs
else
    pkgs=$(need_pkgs); [[ -z $pkgs ]] || die "missing packages: $(oneline "$pkgs") (drop --no-install)"
fi
((install_only)) && { log "packages present"; exit 0; }
export PATH=$PATH:/usr/sbin:/sbin

N=$HPCDP_CLUSTER_NODES
NET=$HPCDP_CLUSTER_SUBNET
CTL_IP=$NET.254
export SLURM_CONF=$C_CONF

# Previous node count (from the last up.sh), to remove nodes that are no longer wanted.
# shellcheck disable=SC1090
prev_nodes=$( (set +u; . "$C_ENVFILE" 2>/dev/null; echo "${HPCDP_CLUSTER_NODES:-0}") )

# ---------------------------------------------------------------- network
# The subnet must be ours alone: refuse if an address in it sits on any other device.
if other=$(ip -4 -o addr show to "$NET.0/24" | awk -v br="$HPCDP_CLUSTER_BRIDGE" '$2 != br {print $2}') && [[ -n $other ]]; then
    die "subnet $NET.0/24 already used by device(s) $(oneline "$other"); set HPCDP_CLUSTER_SUBNET"
fi
if ! ip link show "$HPCDP_CLUSTER_BRIDGE" >/dev/null 2>&1; then
    log "creating bridge $HPCDP_CLUSTER_BRIDGE ($CTL_IP/24)"
    ip link add "$HPCDP_CLUSTER_BRIDGE" type bridge
fi
ip addr replace "$CTL_IP/24" dev "$HPCDP_CLUSTER_BRIDGE"
ip link set "$HPCDP_CLUSTER_BRIDGE" up

# /etc/hosts seen inside every node: the controller (root ns hostname) and all nodes.
CTL_HOST=$(hostname -s 2>/dev/null || cat /proc/sys/kernel/hostname)
CTL_HOST=${CTL_HOST%%.*}
{
    printf '127.0.0.1\tlocalhost\n%s\t%s\n' "$CTL_IP" "$CTL_HOST"
    for ((i = 1; i <= N; i++)); do printf '%s.%d\tnode%d\n' "$NET" "$i" "$i"; done
} >"$C_HOSTS/hosts.tmp"

# tc: apply the shaping on node i's eth0 egress. "none" still installs a (non-shaping)
# pfifo root qdisc so that tc byte counters exist for harness.tc_bytes().
shape() {
    local ns=$1
    if [[ $HPCDP_CLUSTER_RATE == none ]]; then
        tc -n "$ns" qdisc replace dev eth0 root pfifo limit 10000
    else
        tc -n "$ns" qdisc replace dev eth0 root tbf rate "$HPCDP_CLUSTER_RATE" \
            burst "$HPCDP_CLUSTER_BURST" latency "$HPCDP_CLUSTER_TBF_LATENCY"
    fi
}

for ((i = 1; i <= N; i++)); do
    ns=$(netns_of "$i") veth=$(veth_of "$i")
    if [[ ! -e /run/netns/$ns ]]; then
        log "creating node$i (netns $ns, $NET.$i)"
        ip netns add "$ns"
    fi
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
        ip link del "$veth" 2>/dev/null || true
        ip link add "$veth" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$veth" master "$HPCDP_CLUSTER_BRIDGE" up
    ip -n "$ns" addr replace "$NET.$i/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    shape "$ns"
    # Per-node hosts file (identical content; one file per node so it can diverge).
    cp "$C_HOSTS/hosts.tmp" "$C_HOSTS/node$i"
done
rm -f "$C_HOSTS/hosts.tmp"

# ---------------------------------------------------------------- munge
# Own key, socket, pid and log under $C_MUNGE; Slurm is pointed at the socket via AuthInfo.
MUNGE_SOCK=$C_MUNGE/munge.socket
chmod 711 "$C_MUNGE"   # socket reachable by any user; the key itself is 0600
if [[ ! -s $C_MUNGE/munge.key ]]; then
    (umask 077; dd if=/dev/urandom of="$C_MUNGE/munge.key" bs=1024 count=1 status=none)
fi
if ! pid_alive "$C_RUN/munged.pid" munged; then
    log "starting munged"
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
    munged --force --socket="$MUNGE_SOCK" --key-file="$C_MUNGE/munge.key" \
        --pid-file="$C_RUN/munged.pid" --log-file="$C_LOG/munged.log" --seed-file="$C_MUNGE/munged.seed" 9>&- \
        || die "munged failed to start, see $C_LOG/munged.log"
fi

# ---------------------------------------------------------------- slurm.conf
# Job ids: every fresh controller (its state is wiped) starts a range of its own, 10 ids per
# second of wall-clock time since the epoch, wrapping after about 69 days (MaxJobId is
# 67,043,328). MPICH names its shared-memory segments after the job and step id, and a
# segment left in /dev/shm by a killed job must never be picked up by a later job that got
# the same id ("MPIDI_POSIX_comm_bootstrap: Out of memory" in MPI_Init). A range only
# reaches the next bring-up's if it used more than 10 ids per second of its lifetime. Two
# bring-ups within one second: the later starts 10 ids past the earlier (NEW_FIRST_JOB_ID OLD).
new_first_job_id() {
    local id=$(( ($(date +%s) % 6000000) * 10 + 1 )) old=${1:-0}
    if ((id <= old && old < 59999990)); then id=$((old + 10)); fi
    echo "$id"
}
first_job_id=$(sed -n 's/^FirstJobId=//p' "$C_CONF" 2>/dev/null || true)
[[ $first_job_id =~ ^[0-9]+$ ]] || first_job_id=$(new_first_job_id)

write_conf() {
    cat <<EOF
# Generated by tools/cluster/up.sh — do not edit; re-run up.sh instead.
ClusterName=hpcdp
SlurmctldHost=$CTL_HOST($CTL_IP)
SlurmctldPort=$HPCDP_CLUSTER_CTLD_PORT
SlurmdPort=$HPCDP_CLUSTER_SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
ProctrackType=proctrack/linuxproc
# No CPU binding by Slurm: all "nodes" share the same physical cores, and binding
# rank 0 of every node to core 0 would stack them on one core.
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# One line per finished job with its exit code: sbatch --wait reports 0 when the job's
# record was purged (MinJobAge below) before it asked, and the harness then reads it here.
JobCompType=jobcomp/filetxt
JobCompLoc=$C_LOG/jobcomp.txt
MailProg=/bin/true
SchedulerType=sched/backfill
FirstJobId=$first_job_id
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust CPUs= below even where it exceeds the real cores (several ranks per fake node on a
# small machine); without it slurmd reports the real count and the node is drained.
SlurmdParameters=config_overrides
# pip MPICH speaks PMI-2 (not PMIx); the Slurm default (none) would give singletons.
MpiDefault=pmi2
ReturnToService=2
# sbatch --wait polls every MinJobAge/2 s; the default (300) makes it return ~30 s late.
MinJobAge=2
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
SlurmctldPidFile=$C_RUN/slurmctld.pid
SlurmdPidFile=$C_RUN/slurmd-%n.pid
StateSaveLocation=$C_STATE
SlurmdSpoolDir=$C_SPOOL/%n
# One TmpFS per node: with several slurmd on one host the PMIx client dirs collide.
TmpFS=$C_TMP/%n
SlurmctldLogFile=$C_LOG/slurmctld.log
SlurmdLogFile=$C_LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=node[1-$N] NodeAddr=$NET.[1-$N] CPUs=$HPCDP_CLUSTER_CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}
write_conf >"$C_CONF.new"
conf_changed=0
cmp -s "$C_CONF.new" "$C_CONF" || conf_changed=1
mv "$C_CONF.new" "$C_CONF"

# ---------------------------------------------------------------- slurm daemons
stop_slurmds() {  # stop_slurmds FIRST LAST: slurmd of nodes FIRST..LAST plus leftovers in their netns
    local i ns pids
    for ((i = $1; i <= $2; i++)); do
        kill_pidfile "$C_RUN/slurmd-node$i.pid" slurmd
        ns=$(netns_of "$i")
        if [[ -e /run/netns/$ns ]]; then
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            # shellcheck disable=SC2086
            [[ -z $pids ]] || { log "stopping leftover processes in $ns: $(oneline "$pids")"; kill_pids $pids; }
        fi
    done
}

# Nodes dropped since the last up.sh (fewer --nodes): stop them and remove their netns.
if ((prev_nodes > N)); then
    stop_slurmds $((N + 1)) "$prev_nodes"
    for ((i = N + 1; i <= prev_nodes; i++)); do
        ip netns del "$(netns_of "$i")" 2>/dev/null || true
        ip link del "$(veth_of "$i")" 2>/dev/null || true
    done
fi

if ((conf_changed)) && pid_alive "$C_RUN/slurmctld.pid" slurmctld; then
    log "slurm.conf changed: restarting Slurm"
    stop_slurmds 1 "$N"
    kill_pidfile "$C_RUN/slurmctld.pid" slurmctld
fi

if ! pid_alive "$C_RUN/slurmctld.pid" slurmctld; then
    # Fresh controller: wipe its state (no stale jobs or node states survive) and give it a
    # new job-id range; the slurmds restart below with the same slurm.conf.
    rm -rf "${C_STATE:?}"/*
    first_job_id=$(new_first_job_id "$first_job_id")
    write_conf >"$C_CONF"
    stop_slurmds 1 "$N"
    log "starting slurmctld ($CTL_HOST, $CTL_IP:$HPCDP_CLUSTER_CTLD_PORT), job ids from $first_job_id"
    slurmctld -c 9>&- || die "slurmctld failed to start, see $C_LOG/slurmctld.log"
fi

ncores=$(nproc)
for ((i = 1; i <= N; i++)); do
    pidf=$C_RUN/slurmd-node$i.pid
    pid_alive "$pidf" slurmd && continue
    ns=$(netns_of "$i")
    # Leftovers of an earlier run in this node (stepd, tasks) and stale pmix sockets.
    stop_slurmds "$i" "$i"
    rm -rf "${C_SPOOL:?}/node$i" "${C_TMP:?}/node$i"
    mkdir -p "$C_SPOOL/node$i" "$C_TMP/node$i"
    pin=()
    ((HPCDP_CLUSTER_PIN)) && pin=(taskset -c $(((i - 1) % ncores)))
    log "starting slurmd node$i in netns $ns"
    # nsenter --net (NOT `ip netns exec`, which remounts /sys and hides /sys/fs/cgroup
    # from slurmd); then new UTS + private mount namespaces for hostname and /etc/hosts.
    # shellcheck disable=SC2016  # $1/$2 are expanded by the inner sh
    "${pin[@]}" nsenter --net="/run/netns/$ns" \
        unshare --uts --mount --propagation private \
        sh -c 'mount --bind "$1" /etc/hosts && echo "$2" >/proc/sys/kernel/hostname && exec slurmd -N "$2"' \
        sh "$C_HOSTS/node$i" "node$i" 9>&- \
        || die "slurmd node$i failed to start, see $C_LOG/slurmd-node$i.log"
done

# Record what is up, for down.sh, env.sh and harness.py.
cat >"$C_ENVFILE" <<EOF
# Written by tools/cluster/up.sh
HPCDP_CLUSTER_DIR=$HPCDP_CLUSTER_DIR
HPCDP_CLUSTER_NODES=$N
HPCDP_CLUSTER_RATE=$HPCDP_CLUSTER_RATE
HPCDP_CLUSTER_CPUS=$HPCDP_CLUSTER_CPUS
HPCDP_CLUSTER_SUBNET=$NET
HPCDP_CLUSTER_BRIDGE=$HPCDP_CLUSTER_BRIDGE
HPCDP_CLUSTER_VETH_PREFIX=$HPCDP_CLUSTER_VETH_PREFIX
HPCDP_CLUSTER_NETNS_PREFIX=$HPCDP_CLUSTER_NETNS_PREFIX
SLURM_CONF=$C_CONF
EOF

# ---------------------------------------------------------------- wait for idle
deadline=$((SECONDS + HPCDP_CLUSTER_TIMEOUT))
while :; do
    states=$(timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
    nidle=$(awk '$2 == "idle"' <<<"$states" | wc -l)
    ((nidle == N)) && break
    if ((SECONDS >= deadline)); then
        log "sinfo: $(echo "$states" | tr '\n' ';')"
        for f in "$C_LOG/slurmctld.log" "$C_LOG"/slurmd-node*.log; do
            [[ -f $f ]] && { log "--- tail $f"; tail -n 5 "$f" >&2; }
        done
        die "nodes not idle after ${HPCDP_CLUSTER_TIMEOUT}s (got $nidle/$N idle)"
    fi
    # Nodes left down/drained by an earlier incarnation: resume them.
    awk '$2 ~ /^(down|drain|drained|fail)/ {print $1}' <<<"$states" | while read -r n; do
        timeout 10 scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
    done
    sleep 0.2
done
log "up: $N node(s), rate $HPCDP_CLUSTER_RATE, SLURM_CONF=$C_CONF"

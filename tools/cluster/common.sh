# common.sh — shared settings and helpers for up.sh / down.sh (sourced, not run).
#
# Every knob is an environment variable with a default; up.sh records the values it
# used in "$HPCDP_CLUSTER_DIR/cluster.env" so that down.sh and env.sh see the same
# cluster even when they are called with a different environment.
# shellcheck shell=bash disable=SC2034  # the C_* paths are used by up.sh / down.sh

# Where everything lives: configs, logs, pid files, Slurm state/spool, munge key.
HPCDP_CLUSTER_DIR=${HPCDP_CLUSTER_DIR:-/tmp/hpcdp-cluster}
# Number of fake nodes (node1..nodeN) and the egress rate of each node's "NIC".
HPCDP_CLUSTER_NODES=${HPCDP_CLUSTER_NODES:-2}
HPCDP_CLUSTER_RATE=${HPCDP_CLUSTER_RATE:-1gbit}
# tbf parameters (the ones measured in docs/cluster.md).
HPCDP_CLUSTER_BURST=${HPCDP_CLUSTER_BURST:-512kb}
HPCDP_CLUSTER_TBF_LATENCY=${HPCDP_CLUSTER_TBF_LATENCY:-100ms}
# Private /24 for the bridge: nodes get .1..N, the root namespace (slurmctld) .254.
HPCDP_CLUSTER_SUBNET=${HPCDP_CLUSTER_SUBNET:-10.77.0}
HPCDP_CLUSTER_BRIDGE=${HPCDP_CLUSTER_BRIDGE:-hpcdp-br0}
HPCDP_CLUSTER_VETH_PREFIX=${HPCDP_CLUSTER_VETH_PREFIX:-hpcdp-v}
# Network namespace of node i is "${HPCDP_CLUSTER_NETNS_PREFIX}node$i"; the prefix
# keeps us clear of namespaces other people may have called plain "node1".
HPCDP_CLUSTER_NETNS_PREFIX=${HPCDP_CLUSTER_NETNS_PREFIX:-hpcdp-}
# Ports. slurmctld lives in the root namespace, so it gets a non-default port to avoid
# colliding with a system Slurm; each slurmd has a namespace (and port space) of its own.
HPCDP_CLUSTER_CTLD_PORT=${HPCDP_CLUSTER_CTLD_PORT:-16817}
HPCDP_CLUSTER_SLURMD_PORT=${HPCDP_CLUSTER_SLURMD_PORT:-6818}
# CPUs advertised per node (default: all cores; every node sees the same cores).
HPCDP_CLUSTER_CPUS=${HPCDP_CLUSTER_CPUS:-$(nproc)}
# 1 = pin node i's slurmd (and thus its tasks) to core (i-1) mod ncores.
HPCDP_CLUSTER_PIN=${HPCDP_CLUSTER_PIN:-0}
# Bounded waits (seconds): nodes idle after start, daemons gone after kill, apt/dpkg lock.
HPCDP_CLUSTER_TIMEOUT=${HPCDP_CLUSTER_TIMEOUT:-60}
HPCDP_CLUSTER_KILL_TIMEOUT=${HPCDP_CLUSTER_KILL_TIMEOUT:-10}
HPCDP_CLUSTER_APT_TIMEOUT=${HPCDP_CLUSTER_APT_TIMEOUT:-300}

# Derived paths.
C_ETC=$HPCDP_CLUSTER_DIR/etc
C_RUN=$HPCDP_CLUSTER_DIR/run
C_LOG=$HPCDP_CLUSTER_DIR/log
C_STATE=$HPCDP_CLUSTER_DIR/state
C_SPOOL=$HPCDP_CLUSTER_DIR/spool
C_TMP=$HPCDP_CLUSTER_DIR/tmp
C_MUNGE=$HPCDP_CLUSTER_DIR/munge
C_HOSTS=$HPCDP_CLUSTER_DIR/hosts
C_CONF=$C_ETC/slurm.conf
C_ENVFILE=$HPCDP_CLUSTER_DIR/cluster.env
C_LOCK=$HPCDP_CLUSTER_DIR/lock

oneline() { tr -s '\n\t ' ' ' <<<"$1" | sed 's/ $//'; }              # "a\nb" -> "a b"
log()  { printf '[hpcdp-cluster] %s\n' "$*" >&2; }
die()  { printf '[hpcdp-cluster] ERROR: %s\n' "$*" >&2; exit 1; }

netns_of() { printf '%s' "${HPCDP_CLUSTER_NETNS_PREFIX}node$1"; }   # netns name of node i
veth_of()  { printf '%s' "${HPCDP_CLUSTER_VETH_PREFIX}$1"; }          # host side of node i's veth (<=15 chars)

# Take an exclusive lock on the cluster directory (bounded), so that concurrent
# up.sh/down.sh calls serialise instead of racing on namespaces and daemons.
take_lock() {
    mkdir -p "$HPCDP_CLUSTER_DIR"
    exec 9>"$C_LOCK"
    flock -w "${HPCDP_CLUSTER_LOCK_TIMEOUT:-120}" 9 || die "could not lock $C_LOCK within ${HPCDP_CLUSTER_LOCK_TIMEOUT:-120}s (another up.sh/down.sh running?)"
}

# pid_alive PIDFILE COMM: true if the pid in PIDFILE is a live (non-zombie) process whose
# name is COMM. Guards against killing an unrelated process that reused a stale pid.
pid_alive() {
    local pid state comm
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "$2" ]] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ $state != Z && $state != X ]]
}

# wait_gone PID...: wait (bounded) until the given pids are dead or zombies.
wait_gone() {
    local deadline=$((SECONDS + HPCDP_CLUSTER_KILL_TIMEOUT)) p alive st
    while :; do
        alive=()
        for p in "$@"; do
            st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null) || continue
            [[ $st == Z || $st == X ]] || alive+=("$p")
        done
        ((${#alive[@]} == 0)) && return 0
        ((SECONDS >= deadline)) && { printf '%s\n' "${alive[@]}"; return 1; }
        sleep 0.1
    done
}

# kill_pids PID...: SIGTERM, bounded wait, then SIGKILL for the survivors.
kill_pids() {
    (($# == 0)) && return 0
    kill -TERM "$@" 2>/dev/null || true
    local left
    if ! left=$(wait_gone "$@"); then
        log "SIGKILL to $(oneline "$left")"
        # shellcheck disable=SC2086
        kill -KILL $left 2>/dev/null || true
        # shellcheck disable=SC2086  # $left is a list of pids
        wait_gone $left >/dev/null || log "WARNING: pids still alive: $(oneline "$left")"
    fi
}

# kill_pidfile PIDFILE COMM: stop the daemon named by PIDFILE (only if it really is COMM).
kill_pidfile() {
    if pid_alive "$1" "$2"; then
        log "stopping $2 (pid $(cat "$1"))"
        kill_pids "$(cat "$1")"
    fi
    rm -f "$1"
}

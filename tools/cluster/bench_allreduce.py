"""In-job timer: hpcdp's allreduce algorithms next to native ``MPI_Allreduce``, plus the bytes
that cross each node's link. Run it under ``srun`` on the local cluster (docs/cluster.md)::

    srun --mpi=pmi2 -N 2 -n 4 --ntasks-per-node=2 --distribution=block \\
        .venv/bin/python tools/cluster/bench_allreduce.py --size-mib 64 --algos ring,two_level

``tools/cluster/harness.py bench`` writes that job for you. For each algorithm NAME in
``--algos`` (passed as ``hpcdp.allreduce(buf, algo=NAME)``; ``two_level:ring``,
``two_level:doubling``, ``two_level:halving``: two_level with that stage across nodes), over a float32 buffer of
``--size-mib`` MiB:

1. warm-up: one call of NAME, one native ``comm.Allreduce``, each result checked;
2. ``--iters`` trials, alternating: a call of NAME, a native call (A B A B ...); each call is
   timed on every rank between a barrier and its return, the slowest rank's time is the
   call's time, and the line reports the median over the trials; every result is checked
   (buffer filled with rank + 1, the sum must be p (p + 1) / 2 everywhere);
3. a counted phase of ``--count-calls`` calls of NAME alone: local rank 0 of every node reads
   its link's tx byte counter before and after (barriers around), and the line reports the
   **mean over nodes** of the bytes per call. The native figure is counted the same way,
   once per job.

The tx counter is the ``--iface`` (default ``eth0``, the veth that up.sh shapes with tbf)
line of ``/proc/net/dev``, which shows the calling process's network namespace, i.e. the
fake node's. (``/sys/class/net`` would not do: /sys stays the root namespace's mount under
``nsenter --net``, so ``/sys/class/net/eth0`` would be the host's own NIC.) It counts
Ethernet frames, headers and ACKs included, as tc's qdisc counter does.

Rank 0 prints one JSON line per algorithm::

    {"algo", "mpi", "nodes", "ranks_per_node", "placement", "rate", "bytes", "time_s",
     "native_time_s", "internode_bytes_per_node", "native_internode_bytes_per_node", "trials"}

(``mpi``: the library and version, as mpi4py's ``MPI.get_vendor()`` names them; with
``--compression C`` also ``"compression": C``: every hpcdp call compressed, native float32.)

``rate`` is ``$HPCDP_BENCH_RATE`` (set by the harness), else ``$HPCDP_CLUSTER_RATE`` (what
env.sh recorded), else null; ``placement`` is ``--placement`` (default
``$HPCDP_BENCH_PLACEMENT`` or ``block``), checked against where the ranks really are. If
``hpcdp.allreduce`` raises ValueError for NAME (an algorithm this hpcdp does not have, or
``shm`` with ranks on several nodes) the line is ``{"algo", ..., "error": "..."}`` and the
next algorithm runs. A wrong result gives an error line too and exit status 1.

torch is kept out of the job (``sys.modules["torch"] = None``, numpy buffers only): its import
costs ~1.8 s of CPU per rank on a 2-core machine. ``HPCDP_BENCH_TORCH=1`` lets hpcdp import it.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

if os.environ.get("HPCDP_BENCH_TORCH", "0") in ("", "0"):
    sys.modules.setdefault("torch", None)  # hpcdp then finds no torch (see the docstring)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import hpcdp  # noqa: E402
from hpcdp.cli._algos import allreduce_by  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=float, default=64.0, help="float32 buffer size (MiB)")
    ap.add_argument("--algos", default="ring", help="comma-separated hpcdp.allreduce algo names "
                    "(two_level:<stage>: two_level with its stage across nodes forced)")
    ap.add_argument("--iters", type=int, default=5, help="timed trials (pairs: algo, native)")
    ap.add_argument("--compression", default=None,
                    help="hpcdp.allreduce's compression for every algorithm (e.g. fp16; native stays float32)")
    ap.add_argument("--count-calls", type=int, default=2,
                    help="calls of each algorithm in its byte-counted phase")
    ap.add_argument("--placement", default=os.environ.get("HPCDP_BENCH_PLACEMENT", "block"),
                    choices=("block", "cyclic"), help="the srun --distribution the job used")
    ap.add_argument("--iface", default=os.environ.get("HPCDP_BENCH_IFACE", "eth0"),
                    help="the node's link (up.sh shapes eth0)")
    ap.add_argument("--counter", choices=("tc", "dev"), default="tc",
                    help="tc: the root qdisc's Sent bytes (wire bytes: every segment's headers); "
                         "dev: /proc/net/dev tx bytes (GSO packets, fewer headers)")
    a = ap.parse_args(argv)
    if a.iters < 1 or a.count_calls < 1 or a.size_mib <= 0:
        ap.error("--iters and --count-calls must be >= 1, --size-mib > 0")
    return a


def check_own_netns() -> None:
    """Refuse to count in the machine's own network namespace: its eth0 is a real NIC."""
    try:
        same = os.readlink("/proc/self/ns/net") == os.readlink("/proc/1/ns/net")
    except OSError:  # not allowed to look at PID 1's: cannot tell
        return
    if same and os.environ.get("HPCDP_BENCH_ANY_NETNS", "0") in ("", "0"):
        raise RuntimeError("this rank runs in PID 1's network namespace, not inside a cluster node: "
                           "its link counter would be the machine's own NIC (HPCDP_BENCH_ANY_NETNS=1 "
                           "counts anyway)")


def dev_tx_bytes(iface: str) -> int:
    """Bytes transmitted so far by ``iface`` of this process's network namespace, as the
    device counts them (GSO packets: one set of headers per up to 64 KB)."""
    with open("/proc/net/dev") as f:  # /proc/net -> /proc/self/net: our own namespace
        rows = {name.strip(): rest.split() for name, sep, rest in (ln.partition(":") for ln in f) if sep}
    if iface not in rows:
        raise RuntimeError(f"no interface {iface!r} in /proc/net/dev (not inside a cluster node?)")
    return int(rows[iface][8])  # rx: 8 fields, then tx bytes


def tc_tx_bytes(iface: str) -> int:
    """Bytes sent so far through the root qdisc of ``iface`` in this process's network
    namespace (what up.sh shapes; headers of every wire segment included)."""
    tc = shutil.which("tc", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if not tc:
        raise RuntimeError("no tc binary (iproute2): use --counter dev")
    r = subprocess.run([tc, "-s", "qdisc", "show", "dev", iface], capture_output=True, text=True,
                       timeout=10)
    lines = r.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("qdisc ") and " root " in line + " ":
            m = re.search(r"Sent (\d+) bytes", " ".join(lines[i + 1:i + 3]))
            if m:
                return int(m[1])
    raise RuntimeError(f"no root qdisc statistics for {iface!r}: {r.stdout}{r.stderr}")


def layout(comm, local) -> tuple[list[int], int, str]:
    """(node index of every rank, ranks per node, observed placement)."""
    first = local.bcast(comm.rank, root=0)  # the lowest world rank on my node names the node
    firsts = comm.allgather(first)
    order = sorted(set(firsts))
    node_of = [order.index(f) for f in firsts]
    nodes = len(order)
    counts = {n: node_of.count(n) for n in range(nodes)}
    per_node = counts[0] if len(set(counts.values())) == 1 else -1
    p = comm.size
    if per_node > 0 and node_of == [r // per_node for r in range(p)]:
        seen = "block"
    elif node_of == [r % nodes for r in range(p)]:
        seen = "cyclic"
    else:
        seen = "other"
    if nodes == 1 or per_node == 1:
        seen = "any"  # block and cyclic coincide
    return node_of, per_node, seen


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    hpcdp.init()
    try:
        return run(a)
    finally:
        hpcdp.finalize()  # MPI itself is finalised by mpi4py at exit


def run(a) -> int:
    comm = MPI.COMM_WORLD
    rank, p = comm.rank, comm.size
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    is_leader = local.rank == 0
    node_of, per_node, seen = layout(comm, local)
    nodes = max(node_of) + 1
    if seen not in ("any", a.placement):
        if rank == 0:
            print(f"bench_allreduce: placement {a.placement!r} requested but the ranks are laid out "
                  f"{seen!r}: node of each rank {node_of}", file=sys.stderr, flush=True)
        return 2
    tx_bytes = functools.partial(tc_tx_bytes if a.counter == "tc" else dev_tx_bytes, a.iface)
    if is_leader:
        check_own_netns()
        tx_bytes()  # fail early, on every node, if the counter is not there

    count = int(a.size_mib * 2**20) // 4
    nbytes = count * 4
    buf = np.empty(count, dtype=np.float32)
    expected = np.float32(p * (p + 1) // 2)
    rate = os.environ.get("HPCDP_BENCH_RATE") or os.environ.get("HPCDP_CLUSTER_RATE") or None
    vendor, version = MPI.get_vendor()
    head = {"mpi": f"{vendor} {'.'.join(map(str, version))}", "nodes": nodes, "ranks_per_node": per_node,
            "placement": a.placement, "rate": rate, "bytes": nbytes,
            **({"compression": a.compression} if a.compression else {})}
    status = 0

    def native():
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def ours(algo):
        return allreduce_by(algo, buf, False, a.compression)

    def timed(call) -> tuple[float, bool]:
        """One call from a filled buffer: (slowest rank's seconds, result right everywhere)."""
        buf.fill(rank + 1)
        comm.Barrier()
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        ok = bool(buf[0] == expected and buf[-1] == expected and (buf == expected).all())
        both = np.array([dt, 0.0 if ok else 1.0])
        comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)  # elementwise: slowest time, any failure
        return float(both[0]), both[1] == 0.0

    def counted(call) -> float:
        """Mean over nodes of the link bytes per call, over ``count_calls`` calls."""
        buf.fill(1.0)
        comm.Barrier()
        before = tx_bytes() if is_leader else 0
        comm.Barrier()
        for _ in range(a.count_calls):
            call()
        comm.Barrier()
        sent = tx_bytes() - before if is_leader else None
        per_node = [s for s in comm.allgather(sent) if s is not None]
        return statistics.fmean(per_node) / a.count_calls

    def emit(line: dict) -> None:
        if rank == 0:
            print(json.dumps(line), flush=True)

    # native warm-up and its counted phase, once per job
    _, ok = timed(native)
    if not ok:
        emit({"algo": "native", **head, "error": "wrong result from MPI_Allreduce"})
        return 1
    native_bytes = counted(native)

    for algo in [s.strip() for s in a.algos.split(",") if s.strip()]:
        try:
            _, ok = timed(ours(algo))  # warm-up; a ValueError here is raised on every rank
        except ValueError as e:
            comm.Barrier()
            emit({"algo": algo, **head, "error": f"ValueError: {e}"})
            continue
        t_ours, t_native = [], []
        for _ in range(a.iters):
            if not ok:
                break
            dt, ok_a = timed(ours(algo))
            dn, ok_b = timed(native)
            ok = ok_a and ok_b
            t_ours.append(dt)
            t_native.append(dn)
        if not ok:
            emit({"algo": algo, **head, "error": f"wrong result (every element must be {expected})"})
            status = 1
            continue
        emit({"algo": algo, **head, "time_s": statistics.median(t_ours),
              "native_time_s": statistics.median(t_native),
              "internode_bytes_per_node": round(counted(ours(algo))),
              "native_internode_bytes_per_node": round(native_bytes), "trials": a.iters})
    return status


if __name__ == "__main__":
    sys.exit(main())

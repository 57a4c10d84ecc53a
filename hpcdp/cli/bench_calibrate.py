"""``hpcdp-bench calibrate``: measure the cost model's constants (:mod:`hpcdp.comm.costmodel`)
on this machine and write them where ``hpcdp-bench model`` and ``costmodel.load()`` look.

    mpirun -np 4 hpcdp-bench calibrate [--out FILE] [--print-only]

Every constant is the median of ``--reps`` timed repetitions (after one untimed warm-up),
then the slowest rank's value (a collective goes at the pace of its slowest rank), so every
rank holds the same numbers; rank 0 prints one JSON line and writes the file (default
``costmodel.default_path()``, or ``--out``; ``--print-only`` writes nothing). What is measured:

* the profiles, at each size of ``costmodel.PROFILE_SIZES`` (8 B to 16 MiB), which the
  model reads instead of the constants: ``p2p``, a Python-driven ``Sendrecv`` with the ring
  neighbours inside the node (only where every node has two ranks); ``copy``, ``np.copyto``;
  ``add``, ``np.add(a, b, out=a)`` over float32 (every rank at once, as in an allreduce);
  ``native_add``, the same addition by the MPI library (``MPI_Reduce_local`` with ``MPI_SUM``),
  which native allreduce algorithms add with;
* from them: alpha_step (the 8-byte ``Sendrecv``), beta_intra (4 MiB / (time(4 MiB) -
  alpha_step)), beta_mem and gamma (the 4 MiB copy and addition);
* the ``shared_copy``, ``shared_add`` and ``shared_write`` profiles (up to 4 MiB): the same
  copy and addition reading the node window part the next local rank has just written, and
  the copy into a rank's own part after the previous local rank read it, as the
  shared-memory algorithms do (only where every node has two ranks);
* alpha_sync: a flag round of the node's shared window (:mod:`hpcdp.comm.nodewin`), which
  the shared-memory algorithms wait on;
* alpha_call: ``hpcdp.allreduce`` (``check=False``) of an empty array: everything a call
  costs but its messages;
* alpha_round_call: the same call of one float32 element with ``algo="shm"`` (a blocking
  one-round call, its plan kept) less alpha_sync: what such a call costs but its round and
  its bytes (only where every rank is on one node);
* alpha_ring_step: the same call of p float32 elements (one per rank, so every ring step
  carries a message) minus the empty one, per step, minus an 8-byte ``Sendrecv`` on the same
  world ring (so across nodes where the job spans them): the ring's own work per step; the
  three timed in turn in every repetition, medians of the differences;
* alpha_check: the ring's call with its argument check (``check=True``, the default) minus
  without, timed in the same repetitions (0 at np = 1, which checks nothing; every ring call
  here is ``algo="ring"``);
* alpha_native: ``MPI_Allreduce`` of 8 bytes on ``MPI_COMM_SELF`` (a native call's own cost);
* alpha_inter, beta_inter: local rank 0 of the first two nodes exchange 8 bytes and 16 MiB
  (alpha_inter = time(8 B) - alpha_step, beta_inter = 16 MiB / (time(16 MiB) - time(8 B))),
  only when the job spans nodes;
* the ``device_direct`` and ``device_staged`` profiles, where every rank has a GPU and MPI is
  CUDA-aware: ``hpcdp.allreduce`` (average) of a float32 CUDA tensor at each size of
  ``costmodel.DEVICE_SIZES`` (4 KiB to 64 MiB), its memory passed to MPI and staged through
  pinned host memory, in turn, each call ending with a device synchronisation. A CUDA-aware
  MPI's device path can be much slower than staging (an Open MPI built without UCX took 14x
  staging's time at 64 MiB on an H200); ``auto`` then stages where staging was faster
  (``_Runtime.direct``).

What could not be measured (inter-node constants on one node, point-to-point ones with one
rank per node) keeps the default and is listed under ``"defaults"``; ``"notes"`` says why.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np

from hpcdp.comm import costmodel

MIB = 1 << 20
TINY, P2P, SEGMENT, INTER = 8, 4 * MIB, 4 * MIB, 16 * MIB


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hpcdp-bench calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", metavar="FILE",
                    help=f"where rank 0 writes the constants (default {costmodel.default_path()})")
    ap.add_argument("--print-only", action="store_true", help="print the JSON line, write nothing")
    ap.add_argument("--reps", type=int, default=11, help="timed repetitions per constant (median)")
    return ap


def _median(comm, fn, reps: int, inner: int = 1) -> float:
    """Median seconds per ``fn()`` over ``reps`` repetitions of ``inner`` calls (all ranks of
    ``comm`` start each repetition together), after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _ring_exchange(comm, MPI, nbytes: int):
    """A zero-argument ``Sendrecv`` of ``nbytes`` to the right, from the left neighbour."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    return lambda: comm.Sendrecv([send, MPI.BYTE], right, 7, [recv, MPI.BYTE], left, 7)


def _node_p2p(world, local, MPI, reps: int, out: dict, notes: dict) -> None:
    """The ``p2p`` profile (a ring ``Sendrecv`` inside every node per profiled size, the
    slowest node's times), and from it alpha_step (8 bytes) and beta_intra (4 MiB).
    ``local``: the node communicator, None where some node has one rank."""
    if local is None:
        notes["alpha_step"] = notes["beta_intra"] = "a node with one rank: no neighbour inside it"
        return
    times = {n: world.allreduce(_median(local, _ring_exchange(local, MPI, n), reps, _inner(n)),
                                op=MPI.MAX) for n in costmodel.PROFILE_SIZES}
    tiny, big = times[TINY], times[P2P]
    out["p2p"] = [[n, t] for n, t in times.items()]
    out["alpha_step"] = tiny
    out["beta_intra"] = P2P / (big - tiny if big > 2 * tiny else big)


def _inner(nbytes: int) -> int:
    """Calls per timed repetition: enough that a tiny one is not just the clock."""
    return 20 if nbytes <= 64 << 10 else 2


def _memory(world, MPI, reps: int, out: dict) -> None:
    """The ``copy`` (``np.copyto``), ``add`` (``np.add`` over float32) and ``native_add``
    (``MPI_Reduce_local``, ``MPI_SUM`` over float32) profiles, every rank at once, and from
    the first two beta_mem and gamma over a segment."""
    copies, adds, native_adds = [], [], []
    for nbytes in costmodel.PROFILE_SIZES:
        n = max(1, nbytes // 4)
        a, b = np.zeros(n, np.float32), np.full(n, 1e-3, np.float32)
        dst = np.zeros(n, np.float32)
        copy = _median(world, lambda: np.copyto(dst, b), reps, _inner(nbytes))
        add = _median(world, lambda: np.add(a, b, out=a), reps, _inner(nbytes))
        native = _median(world, lambda: MPI.SUM.Reduce_local(b, a), reps, _inner(nbytes))
        copies.append([nbytes, world.allreduce(copy, op=MPI.MAX)])
        adds.append([nbytes, world.allreduce(add, op=MPI.MAX)])
        native_adds.append([nbytes, world.allreduce(native, op=MPI.MAX)])
    out["copy"], out["add"], out["native_add"] = copies, adds, native_adds
    out["beta_mem"] = SEGMENT / dict(copies)[SEGMENT]
    out["gamma"] = SEGMENT / dict(adds)[SEGMENT]


def _shared(world, local, MPI, reps: int, out: dict, notes: dict) -> None:
    """The ``shared_copy`` and ``shared_add`` profiles: ``np.copyto`` from, and ``np.add``
    over float32 of, the node window part that the next local rank has just written (the
    reads the shared-memory algorithms make: the lines come from another core's cache); and
    ``shared_write``: the copy into this rank's part after the previous rank read it; at
    each profiled size up to a segment; every rank at once, each read alone timed between
    the writer's flag round and the next. ``local``: as for :func:`_node_p2p`."""
    if local is None:
        notes["shared_copy"] = notes["shared_add"] = notes["shared_write"] = \
            "a node with one rank: no peer to read from"
        return
    from hpcdp.comm.nodewin import NodeWindow
    from hpcdp.comm.waiting import complete

    sizes = [n for n in costmodel.PROFILE_SIZES if n <= SEGMENT]
    window = NodeWindow(local, MPI)
    window.attach_data(max(sizes))
    peer = (local.Get_rank() + 1) % local.Get_size()

    def flag_round():
        pending = window.post()
        if pending is not None:
            complete(MPI, pending, False)
        window.arrived()

    def after_peer_wrote(mine, source, read, count: int) -> tuple:
        """Median seconds of ``read()`` after the peer's write, and of this rank's write of
        its part after the peer's read of it (what copying into the window costs)."""
        reads, writes = [], []
        for _ in range(count + 1):
            t0 = time.perf_counter()
            mine[:] = source  # the write of what the previous rank reads next
            writes.append(time.perf_counter() - t0)
            flag_round()
            t0 = time.perf_counter()
            read()
            reads.append(time.perf_counter() - t0)
            flag_round()  # nobody writes again before every rank has read
        return statistics.median(reads[1:]), statistics.median(writes[1:])

    try:
        copies, adds, writes = [], [], []
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            parts = window.views(np.dtype(np.float32), n)
            mine, theirs = parts[local.Get_rank()], parts[peer]
            source, a, dst = (np.full(n, 1e-3, np.float32), np.zeros(n, np.float32),
                              np.empty(n, np.float32))
            count = reps * (5 if nbytes <= 64 << 10 else 1)  # small reads: a noisier clock
            copy, write = after_peer_wrote(mine, source, lambda: np.copyto(dst, theirs), count)
            add, _ = after_peer_wrote(mine, source, lambda: np.add(a, theirs, out=a), count)
            copies.append([nbytes, world.allreduce(copy, op=MPI.MAX)])
            adds.append([nbytes, world.allreduce(add, op=MPI.MAX)])
            writes.append([nbytes, world.allreduce(write, op=MPI.MAX)])
        out["shared_copy"], out["shared_add"], out["shared_write"] = copies, adds, writes
    finally:
        window.free()


def _inter(world, MPI, hostnames, reps: int, out: dict, notes: dict) -> None:
    """alpha_inter and beta_inter between local rank 0 of the first two nodes."""
    hosts = list(dict.fromkeys(hostnames))
    if len(hosts) < 2:
        notes["alpha_inter"] = notes["beta_inter"] = "the job runs on one node"
        return
    a, b = hostnames.index(hosts[0]), hostnames.index(hosts[1])
    rank, result = world.Get_rank(), None
    if rank in (a, b):
        pair = world.Split(0, rank)  # a first: its lower rank
        tiny = _median(pair, _ring_exchange(pair, MPI, TINY), reps, 20)
        big = _median(pair, _ring_exchange(pair, MPI, INTER), max(3, reps // 2))
        result = (tiny, INTER / (big - tiny if big > 2 * tiny else big))
        pair.Free()
    else:
        world.Split(MPI.UNDEFINED, rank)
    tiny, out["beta_inter"] = world.bcast(result, root=a)
    out["alpha_inter"] = max(0.0, tiny - out.get("alpha_step", costmodel.DEFAULTS.alpha_step))


def _call(world, MPI, reps: int, out: dict, notes: dict, one_node: bool) -> None:
    """alpha_call (an empty call), alpha_ring_step (per step, a call of one float32 per rank
    minus the empty one and an 8-byte ``Sendrecv`` on the same ring), alpha_check (the
    argument check), alpha_round_call (a one-element ``algo="shm"`` call, its plan kept,
    minus alpha_sync; only where every rank is on one node) and alpha_native (a native call
    on one rank)."""
    import hpcdp
    p = world.Get_size()
    x, empty, tiny = np.zeros(p, np.float32), np.zeros(0, np.float32), np.zeros(1, np.float32)
    step_fn = _ring_exchange(world, MPI, TINY)
    step_fn()
    shm = one_node and p > 1
    if shm:
        hpcdp.allreduce(tiny, check=False, algo="shm")  # (makes the window and the plan)
    calls, steps, checks, rounds = [], [], [], []
    for _ in range(reps + 1):
        calls.append(_median(world, lambda: hpcdp.allreduce(empty, check=False), 1, 20))
        if p > 1:
            full = _median(world, lambda: hpcdp.allreduce(x, check=False, algo="ring"), 1, 20)
            steps.append((full - calls[-1]) / (2 * (p - 1)) - _median(world, step_fn, 1, 20))
            checks.append(_median(world, lambda: hpcdp.allreduce(x, check=True, algo="ring"), 1, 20)
                          - full)
        if shm:
            rounds.append(_median(world, lambda: hpcdp.allreduce(tiny, check=False, algo="shm"), 1, 20))
    out["alpha_call"] = world.allreduce(statistics.median(calls[1:]), op=MPI.MAX)
    notes["alpha_call"] = f"an empty call {out['alpha_call'] * 1e6:.1f} us"
    if p > 1:
        out["alpha_ring_step"] = max(0.0, world.allreduce(statistics.median(steps[1:]), op=MPI.MAX))
        out["alpha_check"] = max(0.0, world.allreduce(statistics.median(checks[1:]), op=MPI.MAX))
    if shm:
        whole = world.allreduce(statistics.median(rounds[1:]), op=MPI.MAX)
        out["alpha_round_call"] = max(0.0, whole - out["alpha_sync"])
        notes["alpha_round_call"] = f"a one-element shm call {whole * 1e6:.1f} us, less a flag round"
    else:
        notes["alpha_round_call"] = "the shared-memory algorithm needs two ranks on one node"
    one = np.zeros(2, np.float32)
    out["alpha_native"] = world.allreduce(_median(
        world, lambda: MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, one, op=MPI.SUM), reps, 20), op=MPI.MAX)


def _flag_round(local, MPI, reps: int) -> float:
    """Median seconds of one flag round of a fresh node window (freed afterwards)."""
    from hpcdp.comm.nodewin import NodeWindow
    from hpcdp.comm.waiting import drive

    window = NodeWindow(local, MPI)

    def rounds():
        for _ in range(20):
            pending = window.post()
            if pending is not None:
                yield pending
            window.arrived()

    try:
        return _median(local, lambda: drive(MPI, rounds(), False), reps) / 20
    finally:
        window.free()


def _device(rt, world, MPI, reps: int, out: dict, notes: dict) -> None:
    """The ``device_direct`` and ``device_staged`` profiles (see the module docstring)."""
    why = None if rt.cuda else "no CUDA device in this process"
    if why is None and not rt.cuda_aware:
        why = f"MPI is not CUDA-aware ({rt.cuda_aware_how}): device buffers are always staged"
    if not world.allreduce(why is None, op=MPI.LAND):
        notes["device_direct"] = notes["device_staged"] = why or "a rank has no GPU or no CUDA-aware MPI"
        return
    import torch

    import hpcdp
    saved, profiles = rt.transport, {"direct": [], "staged": []}
    try:
        for nbytes in costmodel.DEVICE_SIZES:
            x = torch.ones(nbytes // 4, dtype=torch.float32, device=rt.device)

            def call():
                hpcdp.allreduce(x, op="avg")
                torch.cuda.synchronize()  # the data back on the device
            for how, points in profiles.items():
                rt.transport = how
                points.append([nbytes, world.allreduce(_median(world, call, reps, _inner(nbytes)),
                                                       op=MPI.MAX)])
    finally:
        rt.transport = saved
    out["device_direct"], out["device_staged"] = profiles["direct"], profiles["staged"]
    faster = [n for (n, d), (_, s) in zip(profiles["direct"], profiles["staged"]) if s < d]
    notes["device_staged"] = (f"staging faster at {', '.join(map(str, faster))} bytes" if faster
                              else "direct faster at every size")


def measure(rt, reps: int = 11) -> tuple:
    """``(Calibration, measured field names, notes)``, the same on every rank."""
    world, local, MPI = rt.comm.Dup(), rt.local.Dup(), rt.MPI
    out, notes = {}, {}
    try:
        # the node communicator where every node has two ranks (None: a node has one)
        pairs = local if world.allreduce(local.Get_size() > 1, op=MPI.LAND) else None
        _node_p2p(world, pairs, MPI, reps, out, notes)
        _memory(world, MPI, reps, out)
        _shared(world, pairs, MPI, reps, out, notes)
        out["alpha_sync"] = world.allreduce(_flag_round(local, MPI, reps), op=MPI.MAX)
        _inter(world, MPI, rt.hostnames, reps, out, notes)
        _call(world, MPI, reps, out, notes, len(rt.nodes) == 1)
        _device(rt, world, MPI, reps, out, notes)
    finally:
        local.Free()
        world.Free()
    nodes = len(set(rt.hostnames))
    source = rt.comm.bcast(  # rank 0's clock: the same text on every rank
        f"hpcdp-bench calibrate {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, "
        f"np={rt.size} on {nodes} node(s) ({rt.hostnames[0]}{', ...' if nodes > 1 else ''})", root=0)
    cal = costmodel.Calibration.from_dict({**costmodel.DEFAULTS.to_dict(), **out, "source": source})
    return cal, sorted(out), notes


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import hpcdp
    hpcdp.init()
    from hpcdp._runtime import runtime
    rt = runtime()
    t0 = time.perf_counter()
    cal, measured, notes = measure(rt, max(1, args.reps))
    if rt.rank != 0:
        return 0
    path = None if args.print_only else costmodel.save(cal, args.out or costmodel.default_path())
    hosts = list(dict.fromkeys(rt.hostnames))
    rec = {"bench": "calibrate", "np": rt.size, "nodes": len(hosts),
           "ranks_per_node": [rt.hostnames.count(h) for h in hosts], **cal.to_dict(),
           "measured": measured,
           "defaults": [f.name for f in dataclasses.fields(cal)[:-1] if f.name not in measured],
           "notes": notes, "out": str(path) if path else None,
           "seconds": round(time.perf_counter() - t0, 3)}
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

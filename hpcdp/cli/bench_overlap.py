"""``hpcdp-bench overlap``: does a nonblocking ring make progress while the caller computes?

For each size, in one run: the allreduce alone (``comm``), the compute alone
(``compute``: 1-thread torch matmuls sized to last about as long as the
allreduce), then the allreduce started before the compute and waited for after
it, driven three ways:

* ``none``: a polling engine that nobody polls (what MPI gives by itself);
* ``poll``: the same engine polled once per matmul (as DDP hooks poll);
* ``thread``: hpcdp's progress thread.

One JSON object per size and mode: ``{"bench":"overlap","np":..,"bytes":..,"mode":..,
"total_s":..,"wait_s":..,"comm_s":..,"compute_s":..}``; ``wait_s`` is the time left in
``wait()`` after the compute: the communication that was *not* hidden.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


class _Overlap:
    """The runtime, a second engine that only polls (on a communicator of its own) and the
    compute unit (a 1-thread matmul)."""

    def __init__(self, matmul: int):
        import torch

        from hpcdp._runtime import runtime
        from hpcdp.comm.engine import Engine
        self.rt = rt = runtime()
        self.comm, self.MPI = rt.comm, rt.MPI
        self.poll_comm = rt.comm.Dup()
        self.poll_engine = Engine(self.poll_comm, rt.MPI, "poll", rt.yield_cpu)
        self.a = torch.randn(matmul, matmul)

    def compute(self, units: int, poll=None) -> None:
        for _ in range(units):
            self.a @ self.a
            if poll is not None:
                poll()

    def slowest(self, seconds: float) -> float:
        return self.comm.allreduce(seconds, op=self.MPI.MAX)

    def units_for(self, x) -> int:
        """Matmuls that last about 1.2 times one allreduce of ``x`` (rank 0's count)."""
        import hpcdp
        hpcdp.allreduce(x, check=False)
        self.comm.Barrier()
        t0 = time.perf_counter()
        hpcdp.allreduce(x, check=False)
        t_comm = self.slowest(time.perf_counter() - t0)
        self.compute(10)  # warm-up
        t0 = time.perf_counter()
        self.compute(20)
        unit = (time.perf_counter() - t0) / 20
        return self.comm.bcast(max(1, int(1.2 * t_comm / unit)), root=0)

    def timed(self, fn) -> tuple:
        """``(total, 0)`` seconds of ``fn()`` after a barrier."""
        self.comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, 0.0

    def overlapped(self, x, units: int, mode: str) -> tuple:
        """``(total, wait)``: start the allreduce, compute, wait (``wait``: what is left)."""
        import hpcdp
        from hpcdp.collectives import _cfg
        from hpcdp.comm.buffers import as_buffer
        from hpcdp.comm.op import OpContext
        from hpcdp.comm.ring import PlainFrames, ring_allreduce
        if mode != "thread":  # (a generator: nothing runs before it is submitted)
            buf = as_buffer(x)
            tmp = buf.ops.alloc(_cfg.window * max(1, _cfg.segment_bytes // 4))
            gen = ring_allreduce(OpContext(self.poll_comm, self.MPI, 7), buf.n,
                                 PlainFrames(buf, False, self.rt.size), tmp, _cfg, 4)
        self.comm.Barrier()
        t0 = time.perf_counter()
        if mode == "thread":
            h = hpcdp.allreduce_async(x, check=False)
            self.compute(units)
        else:
            h = self.poll_engine.submit(gen, "bench", x)
            self.compute(units, self.poll_engine.progress if mode == "poll" else None)
        tw = time.perf_counter()
        h.wait()
        t1 = time.perf_counter()
        return t1 - t0, t1 - tw


def _one_size(bench: _Overlap, mb: float, trials: int) -> list:
    """The records of one size: medians over the trials of the slowest rank's times."""
    import hpcdp
    x = np.zeros(int(mb * (1 << 20)) // 4, dtype=np.float32)
    units = bench.units_for(x)
    results = {m: [] for m in ("comm", "compute", "none", "poll", "thread")}
    for _ in range(trials):
        results["comm"].append(bench.timed(lambda: hpcdp.allreduce(x, check=False)))
        results["compute"].append(bench.timed(lambda: bench.compute(units)))
        for mode in ("none", "poll", "thread"):
            results[mode].append(bench.overlapped(x, units, mode))
    med = {m: (statistics.median(bench.slowest(t) for t, _ in v),
               statistics.median(bench.slowest(w) for _, w in v)) for m, v in results.items()}
    return [{"bench": "overlap", "np": bench.rt.size, "bytes": x.nbytes, "mode": mode,
             "total_s": med[mode][0], "wait_s": med[mode][1], "comm_s": med["comm"][0],
             "compute_s": med["compute"][0], "mpi": bench.rt.vendor}
            for mode in ("none", "poll", "thread")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hpcdp-bench overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", default="16,64", help="allreduce sizes in MiB (float32)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--matmul", type=int, default=256, help="matmul edge (compute unit)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    import hpcdp
    hpcdp.init()
    if hpcdp.info()["progress"] != "thread":
        print("hpcdp-bench overlap needs HPCDP_PROGRESS=thread (the default)", file=sys.stderr)
        return 2
    bench = _Overlap(args.matmul)
    for mb in [float(s) for s in args.sizes_mb.split(",")]:
        for rec in _one_size(bench, mb, args.trials):
            if bench.rt.rank == 0:
                print(json.dumps(rec), flush=True)
    bench.poll_comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
    from hpcdp._runtime import runtime
    from hpcdp.comm.buffers import as_buffer
    from hpcdp.comm.engine import Engine
    from hpcdp.collectives import _cfg
    from hpcdp.comm.op import OpContext
    from hpcdp.comm.ring import PlainFrames, ring_allreduce

    hpcdp.init()
    rt = runtime()
    if rt.engine.mode != "thread":
        print("hpcdp-bench overlap needs HPCDP_PROGRESS=thread (the default)", file=sys.stderr)
        return 2
    comm, MPI = rt.comm, rt.MPI
    poll_comm = comm.Dup()
    poll_engine = Engine(poll_comm, MPI, "poll", rt.yield_cpu)
    a = torch.randn(args.matmul, args.matmul)

    def compute(units, poll=None):
        for _ in range(units):
            a @ a
            if poll is not None:
                poll()

    for mb in [float(s) for s in args.sizes_mb.split(",")]:
        x = np.zeros(int(mb * (1 << 20)) // 4, dtype=np.float32)
        buf = as_buffer(x)
        tmp = buf.ops.alloc(_cfg.window * max(1, _cfg.segment_bytes // 4))
        hpcdp.allreduce(x, check=False)
        comm.Barrier()
        t0 = time.perf_counter()
        hpcdp.allreduce(x, check=False)
        t_comm = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        compute(10)  # warm-up
        t0 = time.perf_counter()
        compute(20)
        unit = (time.perf_counter() - t0) / 20
        units = comm.bcast(max(1, int(1.2 * t_comm / unit)), root=0)

        results = {m: [] for m in ("comm", "compute", "none", "poll", "thread")}
        for _ in range(args.trials):
            comm.Barrier()
            t0 = time.perf_counter()
            hpcdp.allreduce(x, check=False)
            results["comm"].append((time.perf_counter() - t0, 0.0))
            comm.Barrier()
            t0 = time.perf_counter()
            compute(units)
            results["compute"].append((time.perf_counter() - t0, 0.0))
            for mode in ("none", "poll", "thread"):
                comm.Barrier()
                t0 = time.perf_counter()
                if mode == "thread":
                    h = hpcdp.allreduce_async(x, check=False)
                    compute(units)
                else:
                    gen = ring_allreduce(OpContext(poll_comm, MPI, 7), buf.n,
                                         PlainFrames(buf, False, rt.size), tmp, _cfg, 4)
                    h = poll_engine.submit(gen, "bench", x)
                    compute(units, poll_engine.progress if mode == "poll" else None)
                tw = time.perf_counter()
                h.wait()
                t1 = time.perf_counter()
                results[mode].append((t1 - t0, t1 - tw))
        med = {m: (statistics.median(comm.allreduce(t, op=MPI.MAX) for t, _ in v),
                   statistics.median(comm.allreduce(w, op=MPI.MAX) for _, w in v))
               for m, v in results.items()}
        if rt.rank == 0:
            for mode in ("none", "poll", "thread"):
                print(json.dumps({"bench": "overlap", "np": rt.size, "bytes": x.nbytes, "mode": mode,
                                  "total_s": med[mode][0], "wait_s": med[mode][1],
                                  "comm_s": med["comm"][0], "compute_s": med["compute"][0],
                                  "mpi": rt.vendor}), flush=True)
    poll_comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())

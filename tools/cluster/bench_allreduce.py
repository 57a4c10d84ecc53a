"""Time mpi4py's native ``Allreduce`` of a float32 buffer across the ranks of a job.

Run under the local cluster, e.g. (see docs/cluster.md)::

    srun --mpi=pmi2 -N 2 -n 2 .venv/bin/python tools/cluster/bench_allreduce.py 64 5

Arguments: size in MiB (default 64), timed iterations (default 5). One untimed warm-up
iteration comes first. Rank 0 prints one line per iteration and a summary line
``RESULT size_mib=.. iters=.. min_ms=.. median_ms=.. busbw_gbit=..`` where busbw uses
the usual ring formula S/t * 2(n-1)/n. The result is checked (sum of ones == size).
"""
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> int:
    size_mib = float(sys.argv[1]) if len(sys.argv) > 1 else 64.0
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    comm = MPI.COMM_WORLD
    n = comm.size
    count = int(size_mib * 2**20) // 4
    buf = np.empty(count, dtype=np.float32)
    times = []
    for it in range(iters + 1):
        buf.fill(1.0)
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        dt = time.perf_counter() - t0
        if not (buf[0] == n and buf[-1] == n):
            print(f"rank {comm.rank}: wrong result {buf[0]} {buf[-1]}", flush=True)
            comm.Abort(1)
        dt = comm.allreduce(dt, op=MPI.MAX)  # the slowest rank defines the collective
        if it > 0:
            times.append(dt)
        if comm.rank == 0:
            tag = "warmup" if it == 0 else f"iter {it}"
            print(f"{tag}: {dt * 1e3:.1f} ms on {MPI.Get_processor_name()}", flush=True)
    if comm.rank == 0:
        tmin = min(times)
        busbw = count * 4 * 8 / tmin * 2 * (n - 1) / n / 1e9
        print(f"RESULT size_mib={size_mib:g} ranks={n} iters={iters} min_ms={tmin * 1e3:.1f} "
              f"median_ms={statistics.median(times) * 1e3:.1f} busbw_gbit={busbw:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

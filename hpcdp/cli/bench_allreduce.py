"""``hpcdp-bench allreduce``: hpcdp's allreduce (the default algorithm, ``HPCDP_ALGO`` or
``auto``) against the MPI library's own ``MPI_Allreduce`` (and each algorithm named in
``--algos``, torch gloo with ``--gloo``; ``dist.all_reduce`` over torch.distributed's
"hpcdp" backend and over gloo with ``--backend-compare``), in the same run, same buffers.

Run under the launcher, e.g. ``mpirun -np 4 hpcdp-bench allreduce``. Rank 0
prints one JSON object per size::

    {"bench": "allreduce", "np": 4, "bytes": 16777216, "hpcdp_busbw": ...,
     "native_busbw": ..., "ratio": ..., "ratio_async": ...}

busbw = 2(n-1)/n * bytes / time (GB/s, 1e9), as nccl-tests define it; ``time`` is
the median over trials of the slowest rank's time per call. Trials alternate
hpcdp and native (A B A B ...) so that drift on a noisy machine hits both.

``--device cuda`` times CUDA tensors (on the rank's pinned GPU): hpcdp takes
the tensor as it is (device buffers to MPI where MPI is CUDA-aware and the
calibration does not measure staging faster at that size, else staged through
pinned host memory: ``"transport": "direct"|"staged"``), and the native peer does what a user
would do with the same MPI: ``MPI_Allreduce`` on the device buffer where MPI
is CUDA-aware, else copy to a pinned host buffer, ``MPI_Allreduce``, copy
back (``"native": "device"|"staged"`` in the record). Every call ends with a
device synchronisation, so a time covers the data being back on the GPU.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import numpy as np

from ._algos import allreduce_by
from ._torch_groups import gloo_group
from ._runners import cuda_refused


def _sizes(spec: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for tok in spec.split(","):
        tok = tok.strip().lower().rstrip("ib")
        mult = units.get(tok[-1], 1)
        out.append(int(float(tok[:-1] if tok[-1] in units else tok) * mult))
    return out


def _time_calls(comm, fn, iters: int) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t0) / iters
    return comm.allreduce(dt, op=_max(comm))


def _max(comm):
    from mpi4py import MPI
    return MPI.MAX


def _host_runners(elems, comm, groups, check, algos=()) -> dict:
    """The timed calls: hpcdp's, native MPI's, each algorithm's, and ``dist.all_reduce`` over
    each torch.distributed group of ``groups`` (name -> group; None: the default group)."""
    from mpi4py import MPI

    import hpcdp
    buf = np.zeros(elems, dtype=np.float32)  # stays 0: no overflow, no denormals
    runners = {"hpcdp": lambda: hpcdp.allreduce(buf, check=check),
               "hpcdp_async": lambda: hpcdp.allreduce_async(buf, check=check).wait(),
               "native": lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)}
    for algo in algos:
        runners[algo] = allreduce_by(algo, buf, check)
    if groups:
        import torch
        import torch.distributed as dist
        for name, group in groups.items():
            runners[name] = functools.partial(dist.all_reduce, torch.zeros(elems), group=group)
    return runners


def _device_runners(elems, rt, comm, groups, check, algos=()) -> dict:
    import torch
    from mpi4py import MPI

    import hpcdp
    buf = torch.zeros(elems, dtype=torch.float32, device=rt.device)
    sync = torch.cuda.synchronize
    if rt.cuda_aware:
        def native():
            sync()  # MPI reads device memory: the producing stream must be done
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        host = torch.zeros(elems, dtype=torch.float32, pin_memory=True)
        host_np = host.numpy()

        def native():
            host.copy_(buf)  # synchronous device-to-host
            comm.Allreduce(MPI.IN_PLACE, host_np, op=MPI.SUM)
            buf.copy_(host, non_blocking=True)
            sync()
    runners = {"hpcdp": _synced(lambda: hpcdp.allreduce(buf, check=check), sync),
               "hpcdp_async": _synced(lambda: hpcdp.allreduce_async(buf, check=check).wait(), sync),
               "native": native}
    for algo in algos:
        runners[algo] = _synced(allreduce_by(algo, buf, check), sync)
    if groups:
        import torch.distributed as dist
        for name, group in groups.items():
            runners[name] = _synced(functools.partial(dist.all_reduce, buf.clone(), group=group), sync)
    return runners


def _synced(call, sync):
    """``call``, then a device synchronisation: a time covers the data being back on the GPU."""
    def run():
        call()
        sync()
    return run


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hpcdp-bench allreduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4k,16k,64k,256k,1m,4m,16m,64m,256m",
                    help="buffer sizes in bytes (k/m/g suffixes), float32 elements")
    ap.add_argument("--trials", type=int, default=5, help="alternating trials per size (median)")
    ap.add_argument("--min-time", type=float, default=0.1,
                    help="seconds each timed trial should last (sets iterations per trial)")
    ap.add_argument("--gloo", action="store_true", help="also time torch.distributed gloo all_reduce")
    ap.add_argument("--backend-compare", action="store_true",
                    help="also time dist.all_reduce over the \"hpcdp\" torch.distributed backend "
                         "(torch_hpcdp_*) and over gloo (gloo_*), in the same run")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="buffers in host memory (numpy) or on this rank's GPU (torch CUDA tensors)")
    ap.add_argument("--algos", default="",
                    help="also time these algorithms by name (comma-separated: ring, shm, two_level, "
                         "and two_level:ring|doubling|halving, its stage across nodes forced; "
                         "CUDA buffers take them where staged): fields <algo>_time_s, <algo>_busbw, "
                         "ratio_<algo>")
    ap.add_argument("--no-check", action="store_true",
                    help="skip hpcdp's cross-rank argument check (what DDP does internally)")
    return ap


def _measure(comm, runners: dict, args) -> tuple:
    """``(median seconds per call, iterations per trial)`` of every runner, trials alternating."""
    iters = {}
    for name, fn in runners.items():  # calibrate iterations on a warm-up of each
        fn()
        one = _time_calls(comm, fn, 1)
        iters[name] = comm.bcast(max(1, min(1000, int(args.min_time / max(one, 1e-7)))), root=0)
    times = {name: [] for name in runners}
    for _ in range(args.trials):
        for name, fn in runners.items():
            times[name].append(_time_calls(comm, fn, iters[name]))
    return {k: statistics.median(v) for k, v in times.items()}, iters


def _algos(args) -> list:
    return [a for a in args.algos.split(",") if a]


def _default_algo(rt, nbytes: int, device: str) -> str:
    """What a default call of this size runs (device memory that a CUDA-aware MPI reads
    keeps the ring; staged device buffers pick as host ones, see ``_Runtime.direct``)."""
    from hpcdp.collectives import _pick_algo
    from hpcdp.comm.buffers import as_buffer
    if device != "cpu" and rt.direct(nbytes):
        return "ring"
    return _pick_algo(rt, None, as_buffer(np.empty(nbytes // 4, np.float32)), None)


def _record(rt, args, nbytes: int, med: dict, iters: dict, check: bool) -> dict:
    """One JSON line: times, bus bandwidths and ratios (peer time / hpcdp time)."""
    n = rt.size
    busbw = (2 * (n - 1) / n if n > 1 else 1.0) * nbytes / 1e9
    rec = {"bench": "allreduce", "np": n, "bytes": nbytes, "mpi": rt.vendor, "check": check,
           "algo": _default_algo(rt, nbytes, args.device), "nodes": len(rt.nodes),
           "device": args.device, "hpcdp_time_s": med["hpcdp"], "native_time_s": med["native"],
           "hpcdp_async_time_s": med["hpcdp_async"],
           "hpcdp_busbw": busbw / med["hpcdp"], "native_busbw": busbw / med["native"],
           "ratio": med["native"] / med["hpcdp"], "ratio_async": med["native"] / med["hpcdp_async"],
           "trials": args.trials, "iters": iters["hpcdp"]}
    if args.device == "cuda":
        rec["native"] = "device" if rt.cuda_aware else "staged"
        rec["transport"] = "direct" if rt.direct(nbytes) else "staged"
        rec["cuda_aware_how"] = rt.cuda_aware_how
    for algo in _algos(args):
        rec[f"{algo}_time_s"] = med[algo]
        rec[f"{algo}_busbw"] = busbw / med[algo]
        rec[f"ratio_{algo}"] = med["native"] / med[algo]
    if "gloo" in med:
        rec["gloo_time_s"] = med["gloo"]
        rec["gloo_busbw"] = busbw / med["gloo"]
        rec["ratio_gloo"] = med["gloo"] / med["hpcdp"]
    if "torch_hpcdp" in med:  # dist.all_reduce over the "hpcdp" backend
        rec["torch_hpcdp_time_s"] = med["torch_hpcdp"]
        rec["torch_hpcdp_busbw"] = busbw / med["torch_hpcdp"]
        rec["ratio_torch_hpcdp_to_gloo"] = med["gloo"] / med["torch_hpcdp"]
        rec["ratio_torch_hpcdp_to_native"] = med["native"] / med["torch_hpcdp"]
    return rec


def _torch_groups(rt, args) -> dict:
    """The torch.distributed groups to time, by runner name (None: the default group)."""
    if args.backend_compare:
        import torch.distributed as dist

        import hpcdp.dist  # noqa: F401 (registers the backend)
        dist.init_process_group("hpcdp")
        return {"torch_hpcdp": None, "gloo": dist.new_group(backend="gloo")}
    if args.gloo:
        gloo_group(rt)
        return {"gloo": None}
    return {}


def main(argv=None) -> int:
    """One JSON line per size from rank 0: hpcdp's blocking call (``hpcdp``), the same
    allreduce through the generator path (``hpcdp_async``: ``allreduce_async(x).wait()``,
    what the blocking one-message fast path is measured against), native MPI_Allreduce,
    each algorithm of ``--algos`` by name and with ``--gloo`` torch's gloo. The record's
    ``algo`` says what the default algorithm ran at that size."""
    args = _parser().parse_args(argv)
    import hpcdp
    hpcdp.init()
    from hpcdp._runtime import runtime
    rt = runtime()
    if cuda_refused(rt, args.device, "hpcdp-bench allreduce"):
        return 2
    groups = _torch_groups(rt, args)
    check = not args.no_check
    for nbytes in _sizes(args.sizes):
        elems = nbytes // 4
        runners = _device_runners(elems, rt, rt.comm, groups, check, _algos(args)) \
            if args.device == "cuda" else _host_runners(elems, rt.comm, groups, check, _algos(args))
        med, iters = _measure(rt.comm, runners, args)
        if rt.rank == 0:
            print(json.dumps(_record(rt, args, elems * 4, med, iters, check)), flush=True)
    if groups:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

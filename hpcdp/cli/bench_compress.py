"""``hpcdp-bench compress``: time the compression kernels, numba against numpy (torch for PowerSGD).

Each kernel runs once untimed (JIT compile or cache load, page faults), then
``--repeat`` times; the median wall time is reported. Output is one JSON object
per line: a timing line per (kernel, impl), then a speedup line per kernel
(baseline seconds / numba seconds). PowerSGD's steps run on the elements as
one matrix of ``POWERSGD_COLUMNS`` columns at rank 4; their baseline is its torch
backend on the CPU, on as many threads as numba's. No MPI is used.
"""

import argparse
import contextlib
import importlib.util
import json
import statistics
import time

import numpy as np

from hpcdp.compress import HalfPrecision, OneBit, PowerSGD, has_nonfinite

DEFAULT_ELEMENTS = 16 * 2**20
#: PowerSGD's bucket: one matrix of this many columns (ResNet-50's have 64-4608, GPT-2's
#: 768-3072), at this rank
POWERSGD_COLUMNS, POWERSGD_RANK = 1024, 4


def _powersgd_kernels(impl, x, world):
    """``{name: callable}``: PowerSGD's project (error feedback and P) and decode steps with
    ``impl`` ("numba" or "torch") on the largest prefix of ``x`` that makes whole rows."""
    import torch
    columns = min(POWERSGD_COLUMNS, x.size)
    shape = (x.size // columns, columns)
    comp = PowerSGD(rank=POWERSGD_RANK, start_steps=0, min_compression_rate=0, impl=impl)
    state = comp.new_state(shape[0] * columns, world, 0, name="bench", shapes=[shape])
    grad = torch.from_numpy(x[:shape[0] * columns].copy())
    p = comp.project(grad, state)
    q = comp.back_project(grad, p, state)
    return {"powersgd-project": lambda: comp.project(grad, state),
            "powersgd-decode": lambda: comp.decode(grad, p, q, state, world)}


def _kernels(impl, n, world, seed):
    """``{name: (impl, zero-argument callable)}`` for one implementation ("numba", or the
    baseline "numpy", whose PowerSGD twin is "torch"), inputs prepared."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    acc = np.zeros(n, np.float32)
    onebit = OneBit(impl=impl)
    state = onebit.new_state(n, world, 0, name="bench")
    frames = onebit.encode(x, state)
    # Server input: row 0 of every rank's frames; reuse this rank's frame N times.
    received = np.ascontiguousarray(np.broadcast_to(frames[0], frames.shape))
    gathered = frames.copy()
    kernels = {
        "onebit-encode": lambda: onebit.encode(x, state, out=frames),
        "onebit-server": lambda: onebit.server_reduce(received, state),
        "onebit-decode-accumulate": lambda: onebit.decode(gathered, acc, accumulate=True),
        "nonfinite-check": lambda: has_nonfinite(x, impl=impl),
    }
    for wire in ("fp16", "bf16"):
        half = HalfPrecision(wire, impl=impl)
        payload = half.encode(x, scale=1.0 / world)
        sent = np.empty_like(payload)
        kernels[f"{wire}-encode"] = lambda h=half, p=payload: h.encode(x, scale=1.0 / world, out=p)
        kernels[f"{wire}-decode-accumulate"] = lambda h=half, p=payload: h.decode(
            p, acc, accumulate=True
        )
        kernels[f"{wire}-reduce-encode"] = lambda h=half, p=payload, s=sent: h.reduce_encode(
            p, x, scale=1.0 / world, out=s
        )
    kernels = {name: (impl, fn) for name, fn in kernels.items()}
    if importlib.util.find_spec("torch") is None:  # PowerSGD computes with torch
        return kernels
    psgd = "numba" if impl == "numba" else "torch"
    kernels.update({name: (psgd, fn) for name, fn in _powersgd_kernels(psgd, x, world).items()})
    return kernels


@contextlib.contextmanager
def _torch_threads_as_numba():
    """torch (PowerSGD's baseline) on as many threads as numba's kernels, for the block."""
    try:
        import torch
    except ImportError:
        yield
        return
    import numba
    previous = torch.get_num_threads()
    torch.set_num_threads(numba.get_num_threads())
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _median_seconds(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="hpcdp-bench compress", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--elements", type=int, default=DEFAULT_ELEMENTS, help="float32 elements (default 16M)"
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="timed runs per kernel, median reported"
    )
    parser.add_argument(
        "--world-size", type=int, default=4, help="simulated ranks: 1-bit chunks, 1/N pre-scale"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.elements < 1 or args.repeat < 1 or args.world_size < 1:
        parser.error("--elements, --repeat and --world-size must be >= 1")

    import numba

    seconds = {}
    with _torch_threads_as_numba():
        for side in ("numba", "baseline"):
            impls = _kernels("numba" if side == "numba" else "numpy", args.elements, args.world_size,
                             args.seed)
            for kernel, (impl, fn) in impls.items():
                seconds[kernel, side] = _median_seconds(fn, args.repeat)
                record = {
                    "bench": "compress",
                    "kernel": kernel,
                    "impl": impl,
                    "elements": args.elements,
                    "seconds": seconds[kernel, side],
                }
                print(json.dumps(record), flush=True)
    for kernel in dict.fromkeys(k for k, _ in seconds):
        record = {
            "bench": "compress",
            "kernel": kernel,
            "elements": args.elements,
            "speedup": seconds[kernel, "baseline"] / seconds[kernel, "numba"],
            "numba_threads": numba.get_num_threads(),
            "world_size": args.world_size,
        }
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``hpcdp-bench compress``: time the compression kernels, numba against numpy.

Each kernel runs once untimed (JIT compile or cache load, page faults), then
``--repeat`` times; the median wall time is reported. Output is one JSON object
per line: a timing line per (kernel, impl), then a speedup line per kernel
(numpy seconds / numba seconds). No MPI is used.
"""

import argparse
import json
import statistics
import time

import numpy as np

from hpcdp.compress import HalfPrecision, OneBit, has_nonfinite

DEFAULT_ELEMENTS = 16 * 2**20


def _kernels(impl, n, world, seed):
    """``{name: zero-argument callable}`` for one implementation, inputs prepared."""
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
    return kernels


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
    for impl in ("numba", "numpy"):
        for kernel, fn in _kernels(impl, args.elements, args.world_size, args.seed).items():
            seconds[kernel, impl] = _median_seconds(fn, args.repeat)
            record = {
                "bench": "compress",
                "kernel": kernel,
                "impl": impl,
                "elements": args.elements,
                "seconds": seconds[kernel, impl],
            }
            print(json.dumps(record), flush=True)
    for kernel in dict.fromkeys(k for k, _ in seconds):
        record = {
            "bench": "compress",
            "kernel": kernel,
            "elements": args.elements,
            "speedup": seconds[kernel, "numpy"] / seconds[kernel, "numba"],
            "numba_threads": numba.get_num_threads(),
            "world_size": args.world_size,
        }
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Test oracle: single-process simulations of the compressed allreduces over N virtual ranks.

They call the compressors exactly as the MPI engine does, in the same order,
so they are the oracle for the MPI tests: same payload bytes, same results.
"""

import numpy as np

from hpcdp.compress import OneBit, OneBitState, RingCompressor, get_compressor
from hpcdp.compress.arrays import check_array


def _check_inputs(arrays):
    if len(arrays) == 0:
        raise ValueError("need at least one rank's array, got an empty list")
    n = check_array(arrays[0], "arrays[0]", np.float32).size
    for r, a in enumerate(arrays):
        check_array(a, f"arrays[{r}]", np.float32, size=n)
    return n


def ring_segments(numel, world_size):
    """``(lo, hi)`` of the N ring chunks: sizes differ by at most one, larger first."""
    base, extra = divmod(int(numel), int(world_size))
    bounds = np.cumsum([0] + [base + (c < extra) for c in range(world_size)])
    return [(int(bounds[c]), int(bounds[c + 1])) for c in range(world_size)]


def simulate_half_ring_allreduce(arrays, wire_dtype, *, accumulate_fp32=True, scale=None):
    """Average ``arrays`` (one float32 array per rank) with a compressed ring allreduce.

    ``wire_dtype``: ``"fp16"``, ``"bf16"``, ``"none"`` or a :class:`RingCompressor`.
    ``scale`` defaults to ``1/N`` (pre-division, in float32).

    Chunk c (see :func:`ring_segments`) starts at rank c and travels c, c+1, ...;
    its owner is rank ``c-1 mod N``. In scatter-reduce step i (0..N-2) rank r
    sends chunk ``(r-i) mod N`` to rank r+1; with ``accumulate_fp32`` the
    receiver adds the payload to its own float32 ``x*scale`` and re-encodes
    (``reduce_encode``), otherwise it adds in the wire type to its own payload,
    encoded once at the start (``reduce_wire``). The owner's final payload is
    allgathered and decoded by every rank. Returns one float32 array per rank.
    """
    comp = get_compressor(wire_dtype)
    if not isinstance(comp, RingCompressor):
        raise ValueError(f"simulate_half_ring_allreduce needs a ring compressor, got {comp!r}")
    n = _check_inputs(arrays)
    world = len(arrays)
    factor = 1.0 / world if scale is None else float(scale)
    seg = ring_segments(n, world)

    def chunk(r, c):
        lo, hi = seg[c % world]
        return arrays[r][lo:hi]

    if accumulate_fp32:
        sending = [comp.encode(chunk(r, r), scale=factor) for r in range(world)]
    else:
        encoded = [comp.encode(a, scale=factor) for a in arrays]
        sending = [encoded[r][slice(*seg[r])] for r in range(world)]
    for i in range(world - 1):
        received = [sending[(r - 1) % world] for r in range(world)]
        if accumulate_fp32:
            sending = [
                comp.reduce_encode(received[r], chunk(r, r - i - 1), scale=factor)
                for r in range(world)
            ]
        else:
            sending = [
                comp.reduce_wire(received[r], encoded[r][slice(*seg[(r - i - 1) % world])])
                for r in range(world)
            ]
    # Rank r now holds the final payload of chunk r+1; the allgather copies bytes.
    final = {(r + 1) % world: sending[r] for r in range(world)}
    outputs = []
    for _ in range(world):
        out = np.empty(n, dtype=np.float32)
        for c, (lo, hi) in enumerate(seg):
            comp.decode(final[c], out[lo:hi])
        outputs.append(out)
    return outputs


def simulate_onebit_allreduce(arrays, states, compressor=None, *, return_frames=False):
    """Average ``arrays`` with the two-phase 1-bit allreduce, as N ranks would.

    ``states[r]`` is rank r's :class:`OneBitState` for this bucket (updated in
    place, as on the real ranks). ``compressor`` defaults to ``OneBit()``.
    Returns the N float32 outputs, or with ``return_frames`` a tuple
    ``(outputs, worker_frames, gathered)``: ``worker_frames[r]`` is rank r's
    ``(N, F)`` encode output and ``gathered`` the ``(N, F)`` server frames that
    every rank decodes.
    """
    comp = OneBit() if compressor is None else compressor
    n = _check_inputs(arrays)
    world = len(arrays)
    if len(states) != world:
        raise ValueError(f"expected {world} states (one per rank), got {len(states)}")
    for r, st in enumerate(states):
        if not isinstance(st, OneBitState) or (st.numel, st.world_size, st.rank) != (n, world, r):
            raise ValueError(
                f"states[{r}]: expected a OneBitState with numel={n}, world_size={world}, "
                f"rank={r}, got {st!r}"
            )
    worker_frames = [comp.encode(a, st) for a, st in zip(arrays, states, strict=True)]
    # Phase 1 (all-to-all): server j receives row j of every rank's frames.
    gathered = np.stack(
        [
            comp.server_reduce(np.stack([f[j] for f in worker_frames]), states[j])
            for j in range(world)
        ]
    )
    # Phase 2 (allgather): every rank decodes the same server frames.
    outputs = [comp.decode(gathered, np.empty(n, dtype=np.float32)) for _ in range(world)]
    if return_frames:
        return outputs, worker_frames, gathered
    return outputs


def simulate_powersgd_allreduce(arrays, states, compressor):
    """Average ``arrays`` with PowerSGD as N ranks would: the codec's calls in the
    transport's order, each sum over ranks by the ring simulator (the real ring's bits).
    ``states[r]`` (rank r's :class:`PowerSGDState`) is updated in place; returns the N outputs.
    """
    import torch

    from hpcdp.comm.schedule import simulate

    world = len(arrays)
    outs = [np.array(a, dtype=np.float32, copy=True) for a in arrays]
    if not compressor.is_compressing(states[0]):
        for st in states:
            compressor.skip(st)
        return simulate(outs, finish=lambda v: np.divide(v, v.dtype.type(world), out=v))
    p_sums = simulate([compressor.project(o, st).numpy() for o, st in zip(outs, states)])
    ps = [torch.from_numpy(p) for p in p_sums]
    q_sums = simulate([compressor.back_project(o, p, st).numpy()
                       for o, p, st in zip(outs, ps, states)])
    for o, p, q, st in zip(outs, ps, q_sums, states):
        compressor.decode(o, p, torch.from_numpy(q), st, world)
    return outs

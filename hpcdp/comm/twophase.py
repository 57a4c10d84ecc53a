"""The two-phase compressed allreduce, for any codec whose ``collective`` is ``"two_phase"``
(1-bit with worker and server error feedback, DeepSpeed-style).

1. every rank encodes its whole bucket into N frames (``codec.encode(data, state)``,
   row j for rank j) and sends row j to rank j (an all-to-all);
2. rank j, the *server* of chunk j, reduces the N rows it received into one frame
   (``codec.server_reduce(received, state)``);
3. every rank sends its server frame to every other rank (an allgather), and all
   decode the same N frames (``codec.decode(gathered, data)``), so every rank ends
   with the same bits.

Both exchanges are point-to-point ``Isend``/``Irecv`` of ``MPI.BYTE`` (no MPI
collective touches the buffers), so they work on any MPI and any world size and
count their bytes like the ring does. Where the frames live while MPI moves them
is the space's business (:mod:`hpcdp.comm.spaces`: host, device or staged).
"""
from __future__ import annotations

import numpy as np

from .spaces import HOST

__all__ = ["twophase_allreduce"]


def twophase_allreduce(ctx, data, codec, state, average: bool, space=HOST):
    """Generator: ``data`` (float32) becomes the compressed average (or sum).

    ``data`` and ``codec`` are a numpy array and a host codec, or a device tensor and
    a torch-backed codec with the matching ``space``. ``state``: the bucket's codec state.
    Steps reported to ``ctx.on_step``: 0 (encode and all-to-all), 1 (server step,
    allgather and decode).
    """
    ctx.step_started()
    frames = codec.encode(data, state)                                    # (N, F)
    sent = space.send(frames, space.mirror(frames))
    moved = (ctx.size - 1) * frames.shape[1]
    received = yield from _exchange_rows(ctx, space, sent, sent, "two-phase step 1: all-to-all "
                                         "of worker frames")
    ctx.step_done(0, moved, moved)
    mine = codec.server_reduce(space.load(received), state)              # (F,)
    mine = space.send(mine, space.mirror(mine))
    gathered = yield from _exchange_rows(ctx, space, sent, mine, "two-phase step 2: allgather "
                                         "of server frames")
    codec.decode(space.load(gathered), data)
    if not average:
        data *= np.float32(ctx.size)
    space.done()
    ctx.step_done(1, moved, moved)
    ctx.count(2 * moved, 2 * moved)


def _exchange_rows(ctx, space, like, outgoing, phase: str):
    """Generator: rank p's row ``rank`` of ``outgoing`` (or all of a 1-D ``outgoing``) goes
    to every other rank p, which keeps it as row ``rank`` of an array shaped like ``like``;
    returns this rank's array of the N rows received (its own row copied in place)."""
    rank = ctx.rank
    rows = space.empty_like(like)
    own = outgoing if outgoing.ndim == 1 else outgoing[rank]
    rows[rank] = own
    peers = [(rank + k) % ctx.size for k in range(1, ctx.size)]
    ctx.at(phase)
    reqs = [ctx.irecv(rows[p], p) for p in peers]
    reqs += [ctx.isend(own if outgoing.ndim == 1 else outgoing[p], p) for p in peers]
    if reqs:
        yield reqs
    return rows

"""Low-rank compressed allreduce, for any codec whose ``collective`` is ``"lowrank"``
(PowerSGD): two sums over ranks of small float32 buffers, with the codec's
computation between them.

1. while the codec is not compressing (its uncompressed start), the bucket is
   averaged exactly by ``reduce`` and the codec counts the step (``codec.skip``);
2. ``p = codec.project(data, state)`` (the P factors and the uncompressed tensors),
   summed over ranks by ``reduce``;
3. ``q = codec.back_project(data, p, state)`` (the Q factors), summed likewise;
4. ``codec.decode(data, p, q, state, size, average)``: every rank builds the same
   approximation from the same sums.

``reduce(buffer, average)`` is a generator factory from the caller: the plain ring
(hpcdp's own), over host or device memory. This module moves no bytes itself.
"""
from __future__ import annotations

__all__ = ["lowrank_allreduce"]


def lowrank_allreduce(ctx, data, codec, state, average: bool, reduce):
    """Generator: ``data`` (float32) becomes the compressed average (or sum)."""
    if not codec.is_compressing(state):
        yield from reduce(data, average)
        codec.skip(state)
        return
    p = codec.project(data, state)
    yield from reduce(p, False)
    q = codec.back_project(data, p, state)
    yield from reduce(q, False)
    codec.decode(data, p, q, state, ctx.size, average)

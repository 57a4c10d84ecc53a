"""Two-level allreduce for jobs over several nodes: shared memory inside a node, one ring
per local rank across nodes.

The ranks of a node share a :class:`~hpcdp.comm.nodewin.NodeWindow`; ``S`` is the number
of ranks on the job's smallest node, and local rank ``k < S`` of every node belongs to
cross-node communicator ``k`` (one rank per node, in node order). A buffer is reduced in
segments of at most the window's ``capacity`` bytes; for each segment, cut into ``S``
slices (the ring's chunk bounds):

1. every rank copies the segment into its current half (fp16/bf16 averages: divided by
   the job's size first, so that no sum can overflow);
2. flag round of the node;
3. local rank ``k < S`` adds slice ``k`` of the node's inputs in place in its own part,
   starting with its own and going round the node (intra-node reduce-scatter), then allreduces that partial sum with the same slice of
   every other node over cross communicator ``k`` (hpcdp's ring: owner computes, so every
   node ends with the same bits), divides by the job's size for an average, and writes
   the result there; the ``S`` rings run in parallel, so each
   node's link carries ``2 (nodes - 1) / nodes`` of the buffer, not the flat ring's
   ``2 (p - 1) / p`` times the ranks whose ring edge leaves the node;
4. flag round of the node;
5. every rank copies slice ``k`` out of local rank ``k``'s part (intra-node allgather).

Local ranks ``>= S`` (on nodes with more ranks than the smallest) only contribute their
input and copy the result out: uneven nodes are correct, and their extra ranks add
reduction work on their node but no link traffic.

With a ring codec (fp16, bf16) only step 3's ring across nodes is compressed: the node's
partial sums are exact float32, each hop of the cross ring decodes, adds in float32 and
re-encodes (:class:`~hpcdp.comm.ring.CodecFrames`, every partial sum scaled by
``1 / total`` for an average), and the owner's decoded frame is what every node copies
out, so every rank still holds the same bits.
"""
from __future__ import annotations

from .buffers import Buffer
from .nodewin import node_round
from .ring import CodecFrames, PlainFrames, ring_allreduce
from .schedule import chunk_bounds
from .shm import HALF_DTYPES, copy_in, copy_out, reduce_in_ring_order, segment_elements
from .spaces import HOST

__all__ = ["two_level_allreduce"]


def two_level_allreduce(ctx, window, cross, slices: int, buf, average: bool, total: int,
                        tmp, cfg, codec=None, wire=None):
    """Generator: in-place allreduce of host ``buf`` over all ranks of the job (see the
    module docstring). ``cross``: this rank's :class:`~hpcdp.comm.op.OpContext` on its
    cross-node communicator, ``None`` for local ranks ``>= slices`` (``S``); ``total``: the
    job's number of ranks; ``tmp``, ``cfg``: the cross ring's receive slots and
    configuration. ``codec``: a ring codec for the cross ring (float32 ``buf``), with
    ``wire``, its frames' memory (at least :func:`slice_elements` elements; ``tmp`` then
    holds frames too)."""
    per = segment_elements(window, buf)
    for lo in range(0, buf.n, per):
        yield from _segment(ctx, window, cross, slices, buf, lo, min(buf.n, lo + per), average,
                            total, tmp, cfg, codec, wire)


def slice_elements(window, buf, slices: int) -> int:
    """The most elements a local rank's slice of a segment can have."""
    return -(-min(buf.n, segment_elements(window, buf)) // slices)


def _segment(ctx, window, cross, slices, buf, lo, hi, average, total, tmp, cfg, codec, wire):
    half = buf.dtype.name in HALF_DTYPES
    ctx.at("two-level allreduce: copy in")
    parts = copy_in(window, buf, lo, hi, average, total)
    yield from node_round(ctx, window)
    bounds = chunk_bounds(hi - lo, slices)
    if cross is not None:
        yield from _reduce_slice(ctx, cross, buf, parts, window.rank, bounds,
                                 average and not half, total, tmp, cfg, codec, wire)
    yield from node_round(ctx, window)
    ctx.at("two-level allreduce: copy out")
    copy_out(buf, lo, parts, bounds)
    window.half ^= 1


def _reduce_slice(ctx, cross, buf, parts, k: int, bounds, scale: bool, total: int, tmp, cfg,
                  codec, wire):
    """Generator: slice ``k`` (this rank's) reduced over the node in place in its part (the
    ring's order, :func:`~hpcdp.comm.shm.reduce_in_ring_order`), then across nodes by the
    ring (``codec``'s frames, if given), then divided by ``total`` when ``scale``."""
    ctx.at("two-level allreduce: reduce own slice in the node")
    acc = reduce_in_ring_order(buf.ops, parts, k, bounds, False, 1)
    n = bounds[k + 1] - bounds[k]
    if codec is not None:
        ctx.at(f"two-level allreduce: {codec.name} ring across nodes")
        frames = CodecFrames(codec, acc, wire[:n], wire[:n], 1.0 / total if scale else 1.0, HOST)
        yield from ring_allreduce(cross, n, frames, tmp, cfg, wire.itemsize)
        return
    if cross.size > 1:
        ctx.at("two-level allreduce: ring across nodes")
        frames = PlainFrames(Buffer(acc, n, buf.dtype, buf.ops, buf.name), False, cross.size)
        yield from ring_allreduce(cross, n, frames, tmp, cfg, buf.dtype.itemsize)
    if scale:
        buf.ops.scale(acc, total)

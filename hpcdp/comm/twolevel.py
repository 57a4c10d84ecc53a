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
   starting with its own and going round the node (intra-node reduce-scatter), then
   allreduces that partial sum with the same slice of every other node over cross
   communicator ``k`` (every node ends with the same bits), divides by the job's size for
   an average, and writes the result there; the ``S`` stages run in parallel, so with the
   ring each node's link carries ``2 (nodes - 1) / nodes`` of the buffer, not the flat
   ring's ``2 (p - 1) / p`` times the ranks whose ring edge leaves the node;
4. flag round of the node;
5. every rank copies slice ``k`` out of local rank ``k``'s part (intra-node allgather).

Local ranks ``>= S`` (on nodes with more ranks than the smallest) only contribute their
input and copy the result out: uneven nodes are correct, and their extra ranks add
reduction work on their node but no link traffic. A rank alone on its node (then ``S = 1``)
skips steps 1, 2, 4 and 5: its stage across nodes runs on its buffer in place.

Step 3's reduction across nodes is a pluggable stage (``across``: one of the ``*_across``
generators below with its leading arguments bound), so compression applies there only and
the node's partial sums stay exact:

* :func:`plain_across`: no compression (every dtype), by the ring or, where the cost model
  says it is faster for the slice's size, recursive doubling or halving-doubling
  (:mod:`hpcdp.comm.doubling`: ``log2(nodes)`` rounds where the ring takes
  ``2 (nodes - 1)`` steps);
* :func:`codec_across`: a ring codec (fp16, bf16), by the stage the cost model picks for the
  frames' bytes, as above: on the ring each hop decodes, adds in float32 and re-encodes
  (:class:`~hpcdp.comm.ring.CodecFrames`, every partial sum scaled by ``1 / total`` for an
  average), and the owner's decoded frame is what every node copies out; recursive
  doubling and halving move frames too (:func:`~hpcdp.comm.doubling.codec_doubling_allreduce`);
* :func:`twophase_across`: a two-phase codec (1-bit), over the slice's node sums, with one
  error-feedback state per segment's slice (:meth:`~hpcdp.compress.memory.OneBitState.part`):
  every node decodes the same server frames.

Either way every rank holds the same bits.

Steps reported to ``ctx.on_step`` (level-2 traces), per segment ``s``: ``3s`` (copy in and
the node's round), ``3s + 1`` (own slice reduced in the node and across nodes, with the
bytes the stage across nodes sent and received: ``tally``) and ``3s + 2`` (the round and
copy out).
"""
from __future__ import annotations

from .buffers import Buffer
from .doubling import codec_doubling_allreduce, doubling_allreduce
from .nodewin import node_round
from .ring import CodecFrames, PlainFrames, ring_allreduce
from .schedule import chunk_bounds
from .shm import HALF_DTYPES, copy_in, copy_out, reduce_in_ring_order, segment_elements
from .spaces import HOST
from .twophase import twophase_allreduce

__all__ = ["two_level_allreduce", "StepTally", "slice_elements", "plain_across", "codec_across",
           "twophase_across"]


def two_level_allreduce(ctx, window, slices: int, buf, average: bool, total: int, across, tally):
    """Generator: in-place allreduce of host ``buf`` over all ranks of the job (see the
    module docstring). ``slices``: ``S``; ``total``: the job's number of ranks; ``across``:
    this rank's stage across nodes, ``across(acc, start, scale)`` (a generator reducing
    the node's sum ``acc`` of this rank's slice of the segment at ``start`` over its cross
    communicator, then dividing by ``total`` when ``scale``), ``None`` for local ranks
    ``>= S``. ``tally``: the :class:`StepTally` that is the ``on_step`` of ``across``'s
    communicator (its bytes go into this call's steps)."""
    per = segment_elements(buf, window.capacity)
    ctx.step_started()
    for s, lo in enumerate(range(0, buf.n, per)):
        yield from _segment(ctx, window, slices, buf, lo, min(buf.n, lo + per), average, total,
                            across, tally, 3 * s)


class StepTally:
    """An ``on_step`` for the stage across nodes: adds up the bytes of its steps, which the
    two-level allreduce reports as one step of its own (:meth:`take`)."""

    __slots__ = ("sent", "recv")

    def __init__(self):
        self.sent = self.recv = 0

    def __call__(self, index, t0, t1, sent, recv) -> None:
        self.sent += sent
        self.recv += recv

    def take(self) -> tuple[int, int]:
        moved, self.sent, self.recv = (self.sent, self.recv), 0, 0
        return moved


def slice_elements(window, buf, slices: int) -> int:
    """The most elements a local rank's slice of a segment can have."""
    return -(-min(buf.n, segment_elements(buf, window.capacity)) // slices)


def _segment(ctx, window, slices, buf, lo, hi, average, total, across, tally, step):
    half = buf.dtype.name in HALF_DTYPES
    if window.size == 1:
        yield from _alone(ctx, buf, lo, hi, average, half, total, across, tally, step)
        return
    ctx.at("two-level allreduce: copy in")
    parts = copy_in(window, buf, lo, hi, average, total)
    yield from node_round(ctx, window)
    ctx.step_done(step, 0, 0)
    bounds = chunk_bounds(hi - lo, slices)
    if across is not None:
        ctx.at("two-level allreduce: reduce own slice in the node")
        acc = reduce_in_ring_order(buf.ops, parts, window.rank, bounds, False, 1)
        yield from across(acc, lo, average and not half)
    ctx.step_done(step + 1, *tally.take())
    yield from node_round(ctx, window)
    ctx.at("two-level allreduce: copy out")
    copy_out(buf, lo, parts, bounds)
    window.half ^= 1
    ctx.step_done(step + 2, 0, 0)


def _alone(ctx, buf, lo, hi, average, half, total, across, tally, step):
    """A rank alone on its node: the node's sum is its own input, so its stage across nodes
    (``S = 1``: the whole segment) runs on the buffer in place, without the window's copies
    and flag rounds; the same bits, the same steps reported."""
    acc = buf.data[lo:hi]
    if average and half:
        buf.ops.scale(acc, total)
    ctx.step_done(step, 0, 0)
    yield from across(acc, lo, average and not half)
    ctx.step_done(step + 1, *tally.take())
    ctx.step_done(step + 2, 0, 0)


# -- the stage across nodes (bind the leading arguments with functools.partial) -------------
def plain_across(cross, buf, total: int, tmp, cfg, pick, acc, start: int, scale: bool):
    """Generator: ``acc`` (a slice of ``buf``'s dtype) summed across nodes by what
    ``pick(nbytes)`` names: ``"ring"`` (``tmp``, ``cfg``: its receive slots and
    configuration), ``"doubling"`` or ``"halving"`` (``tmp``: at least ``len(acc)``
    elements). Every rank of ``cross`` holds a slice of the same length, so all pick alike."""
    n = len(acc)
    if cross.size > 1:
        how = pick(n * buf.dtype.itemsize)
        cross.at(f"two-level allreduce: {how} across nodes")
        if how == "ring":
            frames = PlainFrames(Buffer(acc, n, buf.dtype, buf.ops, buf.name), False, cross.size)
            yield from ring_allreduce(cross, n, frames, tmp, cfg, buf.dtype.itemsize)
        else:
            yield from doubling_allreduce(cross, acc, buf.ops, tmp, how)
    if scale:
        buf.ops.scale(acc, total)


def codec_across(cross, codec, wire, total: int, tmp, cfg, pick, acc, start: int, scale: bool):
    """Generator: ring codec ``codec``'s frames over float32 ``acc`` by what
    ``pick(frame bytes)`` names (as :func:`plain_across`); ``wire``: the frames' memory,
    ``tmp``: received frames (the ring's slots), each at least :func:`slice_elements`
    elements."""
    n = len(acc)
    how = pick(n * wire.itemsize) if cross.size > 1 else "ring"
    cross.at(f"two-level allreduce: {codec.name} {how} across nodes")
    factor = 1.0 / total if scale else 1.0
    if how == "ring":
        frames = CodecFrames(codec, acc, wire[:n], wire[:n], factor, HOST)
        yield from ring_allreduce(cross, n, frames, tmp, cfg, wire.itemsize)
    else:
        yield from codec_doubling_allreduce(cross, acc, codec, wire[:n], tmp, how, factor)


def twophase_across(cross, codec, state, ops, total: int, acc, start: int, scale: bool):
    """Generator: two-phase codec ``codec`` over float32 ``acc`` across nodes (the sum), with
    the error-feedback state of this slice (``state.part``), then / ``total`` when ``scale``."""
    part = state.part(start, len(acc), cross.size, cross.rank)
    cross.at(f"two-level allreduce: {codec.name} across nodes")
    yield from twophase_allreduce(cross, acc, codec, part, False)
    if scale:
        ops.scale(acc, total)

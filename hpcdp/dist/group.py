"""``ProcessGroupHpcdp``: a torch.distributed process group whose collectives run on
hpcdp's progress engine.

One group is one MPI communicator (a duplicate of the job's for the default group, a
communicator made by the members for ``dist.new_group``) with a tag counter of its
own, plus a second communicator for ``send``/``recv`` so that user tags never meet
the ring's. A call torch waits for at once (``opts.asyncOp`` False) runs right away and
returns a done Work; any other call returns at once with a Work: the operation queues on
the engine (in call order, behind hpcdp's own), the progress thread drives it and the
Work's future is completed with the output tensors, or with the error naming the rank
and the call (see :mod:`hpcdp.dist.work`). Calls torch has but hpcdp does not raise
``NotImplementedError``.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import torch
import torch.distributed as dist

from ..collectives import _allreduce_gen, _parse_op, _pick_algo
from ..comm.buffers import as_buffer
from ..comm.dtypes import DTYPES
from ..comm.engine import rank_ranges
from ..comm.op import OpContext
from ..objects import allgather_gen
from . import ops
from .work import after_all, completed, submit

__all__ = ["ProcessGroupHpcdp"]


class ProcessGroupHpcdp(dist.ProcessGroup):
    """The ``"hpcdp"`` backend's process group (made by ``dist.init_process_group`` and
    ``dist.new_group``; see :mod:`hpcdp.dist`)."""

    def __init__(self, rt, comm, global_ranks=None, tracer=None):
        super().__init__(comm.Get_rank(), comm.Get_size())
        self.rt, self.comm = rt, comm
        self.p2p = comm.Dup()
        self.whole = global_ranks is None  # the job's ranks in the job's order
        self.ranks = None if self.whole else list(global_ranks)  # group rank -> the job's
        self.label = "" if self.whole else f" [group of ranks {rank_ranges(sorted(global_ranks))}]"
        self._tags = itertools.count()
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._group_name = self._group_desc = ""
        self.tracer = tracer  # records the calls (hpcdp.dist.tracing), None when off

    def getBackendName(self) -> str:
        return "hpcdp"

    # (torch names every group; a ProcessGroup without C++ backends keeps the names itself)
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self):
        return f"<ProcessGroupHpcdp rank {self._rank} of {self._size}{self.label}>"

    # -- helpers ------------------------------------------------------------------------
    def _ctx(self) -> OpContext:
        """A new operation's context: this group's communicator and next tag (a sub-group's
        tells the watchdog its members: a rank outside it may finish before its calls end)."""
        ctx = OpContext(self.comm, self.rt.MPI, next(self._tags) % 32000 + 1,
                        yield_cpu=self.rt.engine.yield_cpu, rank=self._rank, size=self._size)
        if self.ranks is not None:
            ctx.where["members"] = self.ranks
        return ctx

    def _peer(self, r: int, phase: str) -> dict:
        """What the watchdog reads for a message to or from group rank ``r``."""
        return {"phase": phase, "peer": r, "members": [r if self.ranks is None else self.ranks[r]]}

    def _submit(self, call: str, staged, value, where: dict, *steps, opts=None, nbytes=None):
        """Queue ``steps`` (generators, run one after the other) then the staged copies back.
        ``where``: what the stall watchdog reads (the steps' context's); ``opts``: the call's
        options (``asyncOp`` False: run it now, see :func:`~hpcdp.dist.work.submit`);
        ``nbytes``: the call's size for a trace, where it is not ``value``'s."""
        def operation():
            for step in steps:
                yield from step
            staged.finish()
        return submit(self, operation(), call, value, where, _blocking(opts), nbytes)

    # -- reductions ---------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        t = _one(tensors, "allreduce", self._rank)
        if t.layout == torch.sparse_coo:
            return self._sparse_allreduce(t, _op_name(opts), opts)
        return self._allreduce(t, _op_name(opts), "allreduce", tensors, opts)

    def _sparse_allreduce(self, t, op: str, opts=None):
        """A sparse COO tensor (torch DDP's gradient of a sparse embedding), gloo's way: every
        rank's indices and values gathered, summed in rank order on every rank (the same bits
        everywhere). The sum is a new tensor (its nonzeros are not ``t``'s): the Work's value."""
        if op != "SUM":
            raise NotImplementedError(f"rank {self._rank}: the hpcdp backend reduces sparse tensors "
                                      f"with ReduceOp.SUM only (as gloo), got {op}")
        c = t.detach().coalesce()
        values = c.values().float() if t.dtype == torch.bfloat16 else c.values()  # (numpy has no bf16)
        mine = (c.indices().cpu().numpy(), values.cpu().numpy())
        result, ctx = [t], self._ctx()

        def gather():
            everyone = yield from allgather_gen(self.comm, self.rt.MPI, mine)
            indices = torch.from_numpy(np.concatenate([i for i, _ in everyone], axis=1))
            summed = torch.sparse_coo_tensor(indices, torch.from_numpy(np.concatenate(
                [v for _, v in everyone])), t.shape, check_invariants=False).coalesce()
            result[0] = summed.to(t.device, t.dtype)
        return submit(self, gather(), "allreduce", result, ctx.where, _blocking(opts),
                      nbytes=mine[0].nbytes + mine[1].nbytes)

    def _allreduce(self, t, op: str, call: str, value, opts=None):
        ctx = self._ctx()
        if op in ("SUM", "AVG") and _ours(t):  # hpcdp's allreduce, on host or device memory
            staged = ops.Staged()  # (a strided tensor: a contiguous copy, written back, as gloo)
            buf = as_buffer(staged.contiguous(t).detach(), call)
            opcode = _parse_op(op.lower(), buf)
            algo = _pick_algo(self.rt, None, buf, None) if self.whole else "ring"
            return self._submit(call, staged, value, ctx.where,
                                _allreduce_gen(self.rt, ctx, buf, opcode, True, False, None, None,
                                               algo), opts=opts)
        _fold_check(op, t, call, self._rank)
        staged = ops.Staged()
        h = staged.host(t)
        return self._submit(call, staged, value, ctx.where,
                            ops.check(self.rt, ctx, "allreduce", h, ops.op_code(op)),
                            ops.reduce_by_gathering(ctx, h, h, op), opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        """One allreduce of the tensors packed together, unpacked when it ends."""
        if not tensors:
            return completed([])
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        work = self._allreduce(flat, _op_name(opts), "allreduce_coalesced", [flat], opts)
        return work.then(lambda: _unpack(flat, tensors), tensors)

    def reduce(self, tensors, opts=None):
        """``root`` gets the reduction; the other ranks' tensors are left as they were."""
        t = _one(tensors, "reduce", self._rank)
        target = t if self._rank == opts.rootRank else t.detach().clone()
        work = self._allreduce(target, _op_name(opts), "reduce", [target], opts)
        return work if target is t else work.then(None, tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _op_name(opts)
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"rank {self._rank}: reduce_scatter_tensor: the input has "
                             f"{input.numel()} elements, expected output's {output.numel()} x "
                             f"{self._size} ranks = {output.numel() * self._size}")
        if input.dtype != output.dtype:
            raise TypeError(f"rank {self._rank}: reduce_scatter_tensor: input is {input.dtype}, "
                            f"output {output.dtype}; they must match")
        ctx, staged = self._ctx(), ops.Staged()
        inp, out = staged.host(input), staged.host(output)
        check = ops.check(self.rt, ctx, "reduce_scatter", inp, ops.op_code(op))
        if op in ("SUM", "AVG") and _ours(input):
            src = ops.host_buffer(inp, "reduce_scatter input")
            _parse_op(op.lower(), src)
            body = ops.reduce_scatter(self.rt, ctx, out, src, op == "AVG")
        else:
            _fold_check(op, input, "reduce_scatter", self._rank)
            body = ops.reduce_by_gathering(ctx, out, inp, op, self._rank * output.numel())
        return self._submit("reduce_scatter", staged, [output], ctx.where, check, body, opts=opts,
                            nbytes=input.numel() * input.element_size())

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "reduce_scatter", self._rank)
        inputs = _one(input_tensors, "reduce_scatter", self._rank)
        flat = torch.cat([t.detach().reshape(-1) for t in inputs])
        return self.reduce_scatter_single(out, flat, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return after_all(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement ------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        t = _one(tensors, "broadcast", self._rank)
        root = opts.rootRank if opts is not None else 0
        ctx, staged = self._ctx(), ops.Staged()
        h = staged.host(t)
        return self._submit("broadcast", staged, tensors, ctx.where,
                            ops.check(self.rt, ctx, "broadcast", h, 0, root),
                            ops.broadcast(ctx, h, root), opts=opts)

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"rank {self._rank}: all_gather_into_tensor: the output has "
                             f"{output.numel()} elements, expected input's {input.numel()} x "
                             f"{self._size} ranks = {input.numel() * self._size}")
        ctx, staged = self._ctx(), ops.Staged()
        inp, out = staged.host(input), staged.host(output)
        return self._submit("allgather", staged, [output], ctx.where,
                            ops.check(self.rt, ctx, "allgather", inp),
                            ops.allgather(ctx, out, inp), opts=opts)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs = _one(output_tensors, "allgather", self._rank)
        t = _one(input_tensors, "allgather", self._rank)
        flat = torch.empty(self._size * t.numel(), dtype=t.dtype, device=t.device)
        work = self.all_gather_single(flat, t.detach().reshape(-1), opts)
        return work.then(lambda: _unpack(flat, outs), output_tensors)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return after_all(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        ctx, staged = self._ctx(), ops.Staged()
        inp, out = staged.host(input), staged.host(output)
        return self._submit("alltoall", staged, [output], ctx.where,
                            ops.check(self.rt, ctx, "alltoall", inp),
                            ops.alltoall(ctx, out, inp, list(output_split_sizes),
                                         list(input_split_sizes)), opts=opts)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype,
                               device=flat_in.device)
        work = self.all_to_all_single(flat_out, flat_in, [t.numel() for t in output_tensors],
                                      [t.numel() for t in input_tensors], opts)
        return work.then(lambda: _unpack(flat_out, output_tensors), output_tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        t = _one(input_tensors, "gather", self._rank)
        root = opts.rootRank
        ctx, staged = self._ctx(), ops.Staged()
        h = staged.host(t)
        flat = torch.empty(self._size * t.numel(), dtype=t.dtype) if self._rank == root else None
        unpack = (lambda: _unpack(flat, output_tensors[0])) if flat is not None else (lambda: None)
        work = self._submit("gather", staged, output_tensors, ctx.where,
                            ops.check(self.rt, ctx, "gather", h, 0, root),
                            ops.gather(ctx, flat, h, root), opts=opts)
        return work.then(unpack, output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        t = _one(output_tensors, "scatter", self._rank)
        root = opts.rootRank
        ctx, staged = self._ctx(), ops.Staged()
        h = staged.host(t)
        flat = (torch.cat([x.detach().reshape(-1).cpu() for x in input_tensors[0]])
                if self._rank == root else None)
        return self._submit("scatter", staged, output_tensors, ctx.where,
                            ops.check(self.rt, ctx, "scatter", h, 0, root),
                            ops.scatter(ctx, h, flat, root), opts=opts)

    def barrier(self, opts=None):
        ctx = self._ctx()
        marker = torch.empty(0)
        return self._submit("barrier", ops.Staged(), [], ctx.where,
                            ops.check(self.rt, ctx, "barrier", marker), ops.barrier(ctx), opts=opts)

    # -- point to point -----------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int):
        t = _one(tensors, "send", self._rank)
        h = t.detach().contiguous().cpu()  # (a copy of a CUDA tensor, made now)
        req = self.p2p.Isend([ops.as_bytes(h), self.rt.MPI.BYTE], dst, tag)
        return self._submit("send", ops.Staged(), tensors, self._peer(dst, f"send to rank {dst}"),
                            _wait(req, h))

    def recv(self, tensors, src: int, tag: int):
        t = _one(tensors, "recv", self._rank)
        staged = ops.Staged()
        h = staged.host(t)
        req = self.p2p.Irecv([ops.as_bytes(h), self.rt.MPI.BYTE], src, tag)
        return self._submit("recv", staged, tensors, self._peer(src, f"recv from rank {src}"),
                            _wait(req))

    def recv_anysource(self, tensors, tag: int):
        raise NotImplementedError("the hpcdp backend has no recv from any source "
                                  "(dist.recv(src=None)); name the source rank")

    def monitored_barrier(self, *args, **kwargs):
        raise NotImplementedError("the hpcdp backend has no monitored_barrier; use dist.barrier() "
                                  "(a rank that does not arrive is reported by hpcdp's stall "
                                  "watchdog, HPCDP_STALL_TIMEOUT)")

    def allgather_coalesced(self, *args, **kwargs):
        raise NotImplementedError("the hpcdp backend has no allgather_coalesced; call "
                                  "dist.all_gather_into_tensor per tensor")

    # -- lifetime -----------------------------------------------------------------------
    def shutdown(self):
        """Free the group's communicators once the operations queued before are done
        (``dist.destroy_process_group``; every member calls it); flush the trace."""
        if self.comm is None:
            return
        comms = (self.comm, self.p2p)
        self.comm = self.p2p = None
        if self.rt.engine.closed:
            return  # hpcdp was finalised (MPI may be gone): nothing left to free safely
        self.rt.engine.run(functools.partial(_free, comms), f"destroy_process_group{self.label}")
        if self.tracer is not None:
            self.tracer.flush()

    def abort(self):
        self.shutdown()


# -- helpers ------------------------------------------------------------------------------
def _one(tensors, call: str, rank: int):
    if len(tensors) != 1:
        raise NotImplementedError(f"rank {rank}: the hpcdp backend takes one tensor (or one list) "
                                  f"per rank in {call}, got {len(tensors)}")
    return tensors[0]


def _op_name(opts) -> str:
    op = opts.reduceOp.op.name if opts is not None else "SUM"
    if op == "PREMUL_SUM":
        raise NotImplementedError("the hpcdp backend has no ReduceOp.PREMUL_SUM; scale the tensor "
                                  "and use ReduceOp.SUM")
    return op


def _blocking(opts) -> bool:
    """Whether torch waits for the call at once (``async_op=False``: ``opts.asyncOp`` is
    False; torch's option objects default to True, and calls without options are async)."""
    return opts is not None and getattr(opts, "asyncOp", True) is False


def _ours(t) -> bool:
    """Whether hpcdp's own reduction (ring, shared memory) takes ``t``'s dtype."""
    return ops.dtype_name(t) in DTYPES


def _fold_check(op: str, t, call: str, rank: int) -> None:
    """Refuse what a reduction by gathering cannot do, naming the call."""
    if op == "AVG":
        raise TypeError(f"rank {rank}: {call} with ReduceOp.AVG needs a floating dtype that hpcdp "
                        f"reduces ({', '.join(DTYPES)}), got {t.dtype}")
    if op.startswith("B") and (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"rank {rank}: {call} with ReduceOp.{op} needs an integer or bool tensor, "
                        f"got {t.dtype}")


def _unpack(flat, outs) -> None:
    offset = 0
    for o in outs:
        o.copy_(flat[offset:offset + o.numel()].view_as(o))
        offset += o.numel()


def _free(comms) -> None:
    for comm in comms:
        comm.Free()


def _wait(req, keep=None):
    """Generator: wait for a request posted at call time (``keep``: memory it reads)."""
    yield req
    del keep


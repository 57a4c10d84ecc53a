"""One benchmark mode's model replica, optimizer and training step, shared by
``hpcdp-bench train`` and ``hpcdp-bench synthetic``.

A variant is ``(mode, bucket MiB or None, compression or None, algo or None)``:

``single``      no wrapper; only rank 0 steps (on the whole global batch)
``local``       no wrapper; every rank steps on its own batch, nothing is communicated
``naive``       backward, then a blocking native ``MPI_Allreduce`` per gradient
``hpcdp``       ``hpcdp.DistributedDataParallel`` (``hpcdp-sync``: ``overlap=False``,
                ``hpcdp-copy``: ``gradient_as_bucket_view=False``, ``hpcdp-trace``: traced)
``ddp``         ``torch.nn.parallel.DistributedDataParallel`` on gloo; a compression
                registers torch's own comm hook (``fp16_compress_hook``,
                ``bf16_compress_hook``, ``powerSGD_hook`` at the same rank)
``ddp-hpcdp``   the same torch DDP on a process group of hpcdp's backend ``"hpcdp"``
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

__all__ = ["HPCDP_MODES", "TORCH_DDP_MODES", "TORCH_HOOKS", "Runner", "bench_comms", "close",
           "compression_list", "csv_list", "cuda_refused", "hpcdp_compressor", "has_torch_hook",
           "start_runtime"]

HPCDP_MODES = ("hpcdp", "hpcdp-sync", "hpcdp-copy", "hpcdp-trace", "hpcdp-syncbn")
TORCH_DDP_MODES = ("ddp", "ddp-hpcdp")
TORCH_HOOKS = ("fp16", "bf16", "powersgd")
# torch's PowerSGD needs error feedback's first two iterations exact; hpcdp's starts alike
_POWERSGD_START = 2
_NO_CUDA = "--device cuda, but this process sees no CUDA device (no GPU, or a CPU-only torch build)"


def start_runtime(threads: int):
    """hpcdp's runtime for a training benchmark, torch at ``threads`` threads per rank."""
    import torch

    import hpcdp
    from hpcdp._runtime import runtime
    torch.set_num_threads(threads)
    hpcdp.init()
    return runtime()


def cuda_refused(rt, device: str, prog: str) -> bool:
    """True where ``--device cuda`` was asked for and this process has no CUDA; rank 0 says so."""
    if device != "cuda" or rt.cuda:
        return False
    if rt.rank == 0:
        print(f"{prog}: {_NO_CUDA}", file=sys.stderr)
    return True


def csv_list(text: str) -> list[str]:
    """A comma-separated option's non-empty entries."""
    return [t.strip() for t in text.split(",") if t.strip()]


def compression_list(text: str):
    """``--compression`` as a list (None for ``none``), or an error message."""
    from ..compress.registry import get_compressor
    names = csv_list(text) or ["none"]
    try:
        [get_compressor(c) for c in names]
    except ValueError as exc:
        return f"--compression: {exc}"
    if len(set(names)) != len(names):
        return f"--compression takes distinct names, got {text!r}"
    return [None if c == "none" else c for c in names]


def has_torch_hook(compression) -> bool:
    """Whether torch DDP has a comm hook for ``compression`` (None: plain fp32)."""
    return compression is None or compression.split(":")[0] in TORCH_HOOKS


def hpcdp_compressor(name):
    """The DDP's compression: names as given; powersgd compressing from its second step
    (the first re-lays the buckets out, which restarts their state)."""
    if name is None or not name.startswith("powersgd"):
        return name
    from ..compress import PowerSGD, get_compressor
    return PowerSGD(get_compressor(name).rank, start_steps=_POWERSGD_START)


def _register_torch_hook(net, name: str) -> None:
    """torch's own hook for ``name`` on the torch DDP model ``net`` (the default group)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from ..compress import get_compressor
    if name == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=get_compressor(name).rank,
                                            start_powerSGD_iter=_POWERSGD_START)
        net.register_comm_hook(state, _one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
    else:
        raise ValueError(f"torch DDP has no comm hook for compression {name!r}")


def _one_bucket_at_a_time(hook):
    """``hook`` with each bucket's future chain started once the previous bucket's is done.

    torch's ``powerSGD_hook`` starts its P and Q allreduces from future callbacks, so on
    gloo two buckets' collectives can reach the process group in different orders on
    different ranks (seen on the emulated cluster: gloo's "Received data size doesn't
    match expected size", then an abort). Chained, every rank issues them in bucket order.
    """
    import torch
    last = [None]

    def hook_in_order(state, bucket):
        out = torch.futures.Future()

        def start(_previous=None):
            try:
                inner = hook(state, bucket)
            except Exception as exc:  # noqa: BLE001 (handed to DDP through the future)
                out.set_exception(exc)
                return
            inner.add_done_callback(lambda f: _forward(f, out))

        previous, last[0] = last[0], out
        if previous is None or previous.done():
            start()
        else:
            previous.add_done_callback(start)
        return out

    return hook_in_order


def _forward(done, out) -> None:
    try:
        out.set_result(done.value())
    except Exception as exc:  # noqa: BLE001
        out.set_exception(exc)


def bench_comms(rt, device: str) -> dict:
    """What every :class:`Runner` takes beside its variant: ``native`` (the control
    communicator, a duplicate of the job's; :func:`close` frees it), ``gloo`` and ``hpcdp``
    (torch groups, made at their first call: gloo the default group, "hpcdp" beside it),
    ``device`` (``--device``: this rank's GPU or the CPU) and ``trace_dir`` (None until the
    benchmark sets it)."""
    import torch

    from ._torch_groups import gloo_group, hpcdp_group
    return {"native": rt.comm.Dup(), "gloo": lambda: gloo_group(rt),
            "hpcdp": functools.cache(lambda: hpcdp_group(rt)), "trace_dir": None,
            "device": torch.device(rt.device if device == "cuda" else "cpu")}


class Runner:
    """One mode: its own model replica (``build()``, the same seed for every mode),
    optimizer and step function; ``loss_fn(out, y)`` gives the loss to scale."""

    def __init__(self, variant, build, loss_fn, args, rt, comms, trace_name: str = ""):
        import torch

        import hpcdp
        self.mode, self.bucket_mb, self.compression, self.algo = variant
        self.overlap = self.as_view = None
        self.rt = rt
        self.ddp = None
        self.loss_fn = loss_fn
        self.native = comms["native"]
        self.device = comms["device"]
        self.model = build().to(self.device)
        if self.mode == "hpcdp-syncbn":
            self.model = hpcdp.SyncBatchNorm.convert_sync_batchnorm(self.model)
        self.params = list(self.model.parameters())
        net = self.model
        if self.bucket_mb is not None:
            self.overlap = self.mode != "hpcdp-sync"
            self.as_view = self.mode != "hpcdp-copy"
            trace = None
            if self.mode == "hpcdp-trace":
                trace = os.path.join(comms["trace_dir"],
                                     f"{trace_name}-{self.compression or 'none'}-{self.bucket_mb:g}mb")
            self.ddp = net = hpcdp.DistributedDataParallel(self.model, bucket_cap_mb=self.bucket_mb,
                                                           overlap=self.overlap,
                                                           compression=hpcdp_compressor(self.compression),
                                                           gradient_as_bucket_view=self.as_view,
                                                           trace=trace, algo=self.algo)
        elif self.mode in TORCH_DDP_MODES:
            group = None  # the default group: gloo
            if self.mode == "ddp-hpcdp":
                group = comms["hpcdp"]()
            else:
                comms["gloo"]()
            ids = None if self.device.type == "cpu" else [self.device]
            net = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids,
                                                            process_group=group)
            if self.compression is not None:
                _register_torch_hook(net, self.compression)
            self.last_grad_t = 0.0
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._stamp)
        self.net = net
        self.opt = self._optimizer(args)
        self.active = self.mode != "single" or rt.rank == 0
        self.counter = 0
        self.times, self.exposed = [], []
        self.cpu, self.progress_cpu = [], []  # per-step CPU (hpcdp-bench synthetic)
        self.bytes_before = None

    def _optimizer(self, args):
        """The run's optimizer; onebit's compressed-momentum twin (one exact warm-up step)."""
        import torch

        from ..optim import OneBitAdam, OneBitSGD
        adam = args.optimizer == "adam"
        if self.compression == "onebit":
            if adam:
                return OneBitAdam(self.net, lr=args.lr, warmup_steps=1, overlap=self.overlap)
            return OneBitSGD(self.net, lr=args.lr, momentum=args.momentum, warmup_steps=1,
                             overlap=self.overlap)
        if adam:
            return torch.optim.Adam(self.net.parameters(), lr=args.lr)
        return torch.optim.SGD(self.net.parameters(), lr=args.lr, momentum=args.momentum)

    def join_context(self, enabled: bool):
        """The DDP wrapper's ``join()`` (hpcdp's or torch's) when ``enabled``, else nothing."""
        if enabled and (self.ddp is not None or self.mode in TORCH_DDP_MODES):
            return self.net.join()
        return contextlib.nullcontext()

    def _stamp(self, _param) -> None:
        self.last_grad_t = time.perf_counter()

    def step(self, x, y, scale: float) -> float:
        """One training step; returns its exposed communication time (s): from the end of
        backward's computation to averaged gradients in ``.grad`` (hpcdp: the reducer's
        ``exposed_wait_ns``; naive: its allreduces; ddp: from the last gradient's
        accumulation to ``backward()`` returning; 0 without communication)."""
        import torch
        self.opt.zero_grad()
        loss = self.loss_fn(self.net(x), y) * scale
        if self.ddp is not None:
            waited = self.ddp.comm_stats["exposed_wait_ns"]
            loss.backward()
            exposed = (self.ddp.comm_stats["exposed_wait_ns"] - waited) * 1e-9
        else:
            loss.backward()
            end = time.perf_counter()
            if self.mode == "naive":
                self._naive_allreduce()
                exposed = time.perf_counter() - end
            elif self.mode in TORCH_DDP_MODES:
                exposed = end - self.last_grad_t
            else:
                exposed = 0.0
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's time covers its kernels
        return exposed

    def _naive_allreduce(self) -> None:
        """MPI_Allreduce of every gradient, then the division; GPU gradients go to MPI
        directly where it is CUDA-aware, else through a host copy."""
        import torch
        MPI = self.rt.MPI
        for p in self.params:
            if p.grad.is_cuda and not self.rt.cuda_aware:
                host = p.grad.cpu()
                self.native.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
                p.grad.copy_(host)
            else:
                if p.grad.is_cuda:
                    torch.cuda.current_stream().synchronize()
                buf = p.grad if p.grad.is_cuda else p.grad.numpy()
                self.native.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            p.grad.div_(self.rt.size)

    def bytes_sent(self):
        """Rank 0's bytes sent by hpcdp so far (0 without communication, None where the
        transport does not tell: naive, ddp and ddp-hpcdp)."""
        if self.mode in ("single", "local"):
            return 0
        if self.ddp is not None:
            return self.ddp.comm_stats["bytes_sent"]
        return None


def close(native) -> None:
    """End of a benchmark: the gloo group if one was made, and the control communicator."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    native.Free()

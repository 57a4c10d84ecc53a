"""Error-feedback memory of the 1-bit compressor, and its bucket layout.

Layout of a bucket of ``n`` float32 elements over ``N`` ranks: the bucket is
padded (conceptually: nothing is allocated) to ``N * m`` elements with
``m = 8 * ceil(n / (8 N))``, so each of the N chunks packs into a whole number
of bytes. Chunk j is ``[j*m, (j+1)*m)``; rank j is its server. Only the first
``n`` elements are real: padding is never summed, never stored in a residual,
and packs as bit 1.
"""

import numpy as np

from .base import BucketState


def chunk_numel(numel, world_size):
    """Elements per chunk ``m = 8 * ceil(numel / (8 * world_size))`` (padding included)."""
    return 8 * -(-int(numel) // (8 * int(world_size)))


def owned_range(numel, world_size, rank):
    """``(lo, hi)``: the real elements of chunk ``rank`` (empty if it is all padding)."""
    m = chunk_numel(numel, world_size)
    lo = min(rank * m, numel)
    return lo, min(lo + m, numel)


def valid_counts(numel, world_size):
    """Real (unpadded) element count of each chunk, as an int64 array of length N."""
    m = chunk_numel(numel, world_size)
    return np.clip(numel - np.arange(world_size, dtype=np.int64) * m, 0, m)


class OneBitState(BucketState):
    """Residuals of one bucket on one rank, plus the number of steps done.

    ``worker_residual`` (``numel`` float32): what this rank's 1-bit encoding of
    the whole bucket has not yet delivered. ``server_residual`` (the real
    elements of chunk ``rank``): the same for this rank's server re-encoding.
    ``step`` counts encodes, warm-up steps included.

    Under the two-level allreduce a rank compresses only its slices of the node's
    sums, across nodes: each segment's slice has a state of its own in ``parts``
    (:meth:`part`, keyed by the segment's first element), and this state's own
    residuals stay zero.

    Residuals are per rank and per world size: save one state dict per rank.
    They are numpy arrays, or torch tensors on the bucket's device once a GPU
    bucket used the state (:meth:`to_device`).
    """

    __slots__ = ("step", "worker_residual", "server_residual", "parts", "_saved_parts",
                 "server_mean")
    kind = "onebit"

    def __init__(self, name, numel, world_size, rank):
        super().__init__(name, numel, world_size, rank)
        lo, hi = owned_range(self.numel, self.world_size, self.rank)
        self.step = 0
        self.worker_residual = np.zeros(self.numel, dtype=np.float32)
        self.server_residual = np.zeros(hi - lo, dtype=np.float32)
        self.parts = {}         # segment start -> OneBitState of this rank's slice across nodes
        self._saved_parts = {}  # segment start -> state dict from a checkpoint, restored on use
        self.server_mean = None  # the server phase's scratch (not state: rewritten every step)

    def part(self, start, numel, world_size, rank):
        """The state of this rank's slice of the segment at ``start`` (``numel`` elements,
        compressed across ``world_size`` nodes as node ``rank``): made on first use, from the
        checkpoint's if one was loaded (which must match, see :meth:`load_state_dict`). Its
        step follows this state's, so the warm-up ends for every slice with the bucket's."""
        state = self.parts.get(start)
        if state is None:
            state = OneBitState(f"{self.name}[{start}:]", numel, world_size, rank)
            saved = self._saved_parts.pop(start, None)
            if saved is not None:
                state.load_state_dict(saved)
            self.parts[start] = state
        elif (state.numel, state.world_size, state.rank) != (numel, world_size, rank):
            raise ValueError(
                f"bucket {self.name!r}: its slice from element {start} has {state.numel} "
                f"elements over {state.world_size} nodes as node {state.rank}, this call "
                f"{numel} over {world_size} as {rank}: a bucket's two-level layout must not change")
        state.step = self.step
        return state

    def __repr__(self):
        return f"{super().__repr__()[:-1]}, step={self.step})"

    def to_device(self, device):
        """Keep the residuals as torch tensors on ``device``; returns the state.

        The first call for a device moves them there (zeros, or what a checkpoint
        restored); later calls find them in place and do nothing.
        """
        import torch

        for key in ("worker_residual", "server_residual"):
            value = getattr(self, key)
            if not isinstance(value, torch.Tensor) or value.device != device:
                setattr(self, key, torch.as_tensor(value).to(device))
        return self

    def residual_norm(self) -> float:
        """L2 norm of the worker residuals, the bucket's and its two-level slices' (what the
        divergence guard compares)."""
        squares = [_norm(self.worker_residual) ** 2]
        squares += [_norm(p.worker_residual) ** 2 for p in self.parts.values()]
        return float(np.sqrt(sum(squares)))

    def state_dict(self):
        """Plain values and host numpy copies of the residuals, wherever they live."""
        state = super().state_dict()
        state["step"] = self.step
        state["worker_residual"] = _host_copy(self.worker_residual)
        state["server_residual"] = _host_copy(self.server_residual)
        state["parts"] = {start: p.state_dict() for start, p in self.parts.items()}
        state["parts"].update(self._saved_parts)
        return state

    def load_state_dict(self, state):
        """Restore from :meth:`state_dict` output (arrays may be torch CPU tensors)."""
        super().load_state_dict(state)
        arrays = {}
        for key in ("worker_residual", "server_residual"):
            if key not in state:
                raise KeyError(f"bucket {self.name!r}: state dict has no {key!r} entry")
            value = np.asarray(state[key], dtype=np.float32)
            expected = getattr(self, key).shape
            if value.shape != expected:
                raise ValueError(
                    f"bucket {self.name!r}: {key} in the checkpoint has shape {value.shape}, "
                    f"expected {expected}"
                )
            arrays[key] = value
        step = int(state.get("step", -1))
        if step < 0:
            raise ValueError(
                f"bucket {self.name!r}: checkpoint step must be >= 0, got {state.get('step')!r}"
            )
        for key, value in arrays.items():
            target = getattr(self, key)
            if isinstance(target, np.ndarray):
                target[:] = value
            else:  # residuals on a torch device
                import torch

                target.copy_(torch.from_numpy(value))
        self.step = step
        self.parts = {}
        self._saved_parts = {int(start): part for start, part in state.get("parts", {}).items()}


def _norm(residual) -> float:
    if isinstance(residual, np.ndarray):
        return float(np.sqrt(np.dot(residual, residual)))
    return float(residual.norm())


def _host_copy(residual):
    """A numpy copy of a residual held as a numpy array or a torch tensor (any device)."""
    if isinstance(residual, np.ndarray):
        return residual.copy()
    return residual.detach().to("cpu", copy=True).numpy()

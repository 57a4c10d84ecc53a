"""The one owner of compressor state: :class:`StateStore`.

A stateful compressor (1-bit: error-feedback residuals) keeps one state per
bucket and rank. The runtime holds one store; an allreduce with compression
finds its bucket's state there by the buffer's name and length, so the public
``hpcdp.allreduce(x, name=..., compression=...)`` and the DDP reducer (which names
its buckets ``<prefix>bucket<i>``) share one mechanism, and a checkpoint saves and
restores the states of one prefix.
"""

__all__ = ["StateStore"]


class StateStore:
    """Per-bucket compressor states of one rank, created on first use."""

    def __init__(self, world_size: int, rank: int):
        self.world_size = int(world_size)
        self.rank = int(rank)
        self._states = {}  # (bucket name, numel) -> state

    def get(self, comp, name: str, numel: int, shapes=None):
        """The state of bucket ``name`` of ``numel`` elements (``comp.new_state`` on first use;
        ``shapes``: the shapes of the tensors the bucket holds, for compressors that use them)."""
        key = (name, int(numel))
        state = self._states.get(key)
        if state is None:
            state = comp.new_state(numel, self.world_size, self.rank, name=name, shapes=shapes)
            self._states[key] = state
        return state

    def _keys(self, prefix: str):
        return [k for k in self._states if k[0].startswith(prefix)]

    def clear(self, prefix: str = "") -> None:
        """Forget the states of the buckets whose name starts with ``prefix``."""
        for key in self._keys(prefix):
            del self._states[key]

    def state_dict(self, prefix: str = "") -> dict:
        """``{"<name without prefix>:<numel>": state dict}`` for the buckets under ``prefix``."""
        return {f"{name[len(prefix):]}:{numel}": self._states[(name, numel)].state_dict()
                for name, numel in self._keys(prefix)}

    def load_state_dict(self, states: dict, comp, prefix: str = "") -> None:
        """Restore what :meth:`state_dict` returned, as states of ``comp`` (same world size
        and rank: each state checks that it was saved for this bucket, rank and size)."""
        for key, saved in states.items():
            name, _, numel = key.rpartition(":")
            state = comp.new_state(int(numel), self.world_size, self.rank, name=prefix + name)
            state.load_state_dict(saved)
            self._states[(prefix + name, int(numel))] = state

"""Gradient compression for hpcdp's allreduce: fp16/bf16, 1-bit with error feedback, PowerSGD.

No MPI here: the transport (``hpcdp.comm``) moves the payloads and calls these
compressors at fixed points of its collective (see ``docs/compression.md``).
The numba kernels compile on first use, not at import; torch is imported only
when a compressor is asked for its torch backend (``to_torch()``).
"""

from .base import BucketState, Compressor, RingCompressor
from .halfprec import HalfPrecision, NoCompression, has_nonfinite
from .memory import OneBitState, chunk_numel, owned_range
from .onebit import OneBit
from .powersgd import PowerSGD, PowerSGDState
from .registry import COMPRESSOR_NAMES, code, code_name, get_compressor, resolve
from .state import StateStore

__all__ = [
    "COMPRESSOR_NAMES",
    "BucketState",
    "Compressor",
    "HalfPrecision",
    "NoCompression",
    "OneBit",
    "OneBitState",
    "PowerSGD",
    "PowerSGDState",
    "RingCompressor",
    "StateStore",
    "chunk_numel",
    "code",
    "code_name",
    "get_compressor",
    "has_nonfinite",
    "owned_range",
    "resolve",
]

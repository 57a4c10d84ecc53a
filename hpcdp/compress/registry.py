"""``get_compressor``: compressor names to instances."""

from .base import Compressor
from .halfprec import HalfPrecision, NoCompression
from .onebit import OneBit

COMPRESSOR_NAMES = ("none", "fp16", "bf16", "onebit")


def get_compressor(spec):
    """Map ``None``, a name in ``COMPRESSOR_NAMES`` or a :class:`Compressor` to an instance.

    Names give the defaults: ``"onebit"`` is ``OneBit(warmup_steps=0)``; build
    ``OneBit(warmup_steps=...)`` yourself for a warm-up.
    """
    if isinstance(spec, Compressor):
        return spec
    if spec is None or spec == "none":
        return NoCompression()
    if spec in ("fp16", "bf16"):
        return HalfPrecision(spec)
    if spec == "onebit":
        return OneBit()
    raise ValueError(
        f"unknown compressor {spec!r}; valid names: {', '.join(COMPRESSOR_NAMES)} "
        "(or None, or a hpcdp.compress.Compressor instance)"
    )

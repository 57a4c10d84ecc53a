"""The one registry of compressors: names, wire codes, and which codec a call uses.

Everything that lists or resolves compressors reads it: the collectives (the
cross-rank argument check sends :func:`code`), the DDP reducer, the command-line
choices (:data:`COMPRESSOR_NAMES`) and the trace files (which store the names).
"""

from .base import Compressor
from .halfprec import HalfPrecision, NoCompression
from .onebit import OneBit
from .powersgd import PowerSGD

#: name -> (factory giving the default instance, code sent in the cross-rank argument check)
_REGISTRY = {
    "none": (NoCompression, 0),
    "fp16": (lambda: HalfPrecision("fp16"), 1),
    "bf16": (lambda: HalfPrecision("bf16"), 2),
    "onebit": (OneBit, 3),
    "powersgd": (PowerSGD, 4),
}
_CUSTOM_CODE = 9

COMPRESSOR_NAMES = tuple(_REGISTRY)


def get_compressor(spec):
    """Map ``None``, a name in ``COMPRESSOR_NAMES`` or a :class:`Compressor` to an instance.

    Names give the defaults: ``"onebit"`` is ``OneBit(warmup_steps=0)``, ``"powersgd"``
    is ``PowerSGD(rank=2)`` and ``"powersgd:R"`` rank R; build the instances yourself
    for other options.
    """
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str) and spec.startswith("powersgd:"):
        rank = spec.partition(":")[2]
        if not rank.isdigit() or int(rank) < 1:
            raise ValueError(f"compressor {spec!r}: the rank after 'powersgd:' must be an integer >= 1")
        return PowerSGD(rank=int(rank))
    entry = _REGISTRY.get("none" if spec is None else spec)
    if entry is None:
        raise ValueError(
            f"unknown compressor {spec!r}; valid names: {', '.join(COMPRESSOR_NAMES)} "
            "(or None, or a hpcdp.compress.Compressor instance)"
        )
    return entry[0]()


def code(comp) -> int:
    """The small integer that names ``comp`` (a compressor or None) in cross-rank checks."""
    name = "none" if comp is None else comp.name
    entry = _REGISTRY.get(name)
    return entry[1] if entry is not None else _CUSTOM_CODE


def code_name(value: int) -> str:
    """The compressor name behind a :func:`code` (``"custom"`` for user compressors)."""
    for name, (_, c) in _REGISTRY.items():
        if c == value:
            return name
    return "custom" if value == _CUSTOM_CODE else f"<unknown compressor code {value}>"


def resolve(spec, tensor: str, dtype: str, device: str, owner: str = "hpcdp"):
    """The compressor that reduces one tensor, or None for the plain (uncompressed) ring.

    ``tensor`` names it in errors, ``dtype`` is its element type (``"float32"`` or
    ``"torch.float32"``), ``device`` where it lives: ``"cpu"`` (host memory: the compressor
    itself), ``"cuda"``/``"cuda:N"`` (a torch CUDA tensor: the compressor's torch twin,
    which computes on the device) or anything else (which no compressor reads). Raises
    ``TypeError`` naming ``owner``, the tensor, its dtype and device otherwise.
    """
    if spec is None:
        return None
    comp = get_compressor(spec)
    if isinstance(comp, NoCompression):
        return None
    host, cuda = device == "cpu", device.split(":")[0] == "cuda"
    float32 = dtype.replace("torch.", "") == "float32"
    if not float32 or not (host or cuda):
        fix = ("pass a torch tensor (torch.as_tensor(x, device='cuda') is zero copy)" if float32
               else "keep it float32")
        raise TypeError(f"{owner}: compression={comp.name!r} needs float32 tensors on the CPU or a "
                        f"CUDA device (numpy arrays, torch CPU or CUDA tensors), but {tensor!r} is "
                        f"{dtype} on {device}; {fix} or use compression=None")
    return comp if host else comp.to_torch()

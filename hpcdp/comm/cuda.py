"""Is the loaded MPI CUDA-aware? Decide once, say how it was decided.

``HPCDP_CUDA_AWARE=1`` or ``0`` forces the answer. ``auto`` (the default) asks
the MPI library that is actually loaded in this process:

1. ``MPIX_Query_cuda_support()`` (Open MPI's and MPICH's extension, which Intel
   MPI has too; MPICH answers at run time from its GPU support, Open MPI from its
   build and the CUDA library it finds), called through ctypes because mpi4py
   does not wrap it;
2. Open MPI without that symbol: ``ompi_info --parsable`` next to the loaded
   library (``mpi_built_with_cuda_support``);
3. MVAPICH2: ``MV2_USE_CUDA=1`` in the environment.

If none of these can tell, the answer is *not CUDA-aware*: device buffers are
staged through pinned host memory, which is always correct, and the reason is
reported by :func:`hpcdp.info` so nobody has to guess.
"""
from __future__ import annotations

import ctypes
import os
import subprocess

__all__ = ["detect_cuda_aware", "loaded_libmpi"]


def loaded_libmpi() -> str | None:
    """Path of the libmpi shared object mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                base = os.path.basename(path)
                if base.startswith("libmpi.so") or base.startswith("libmpi_abi.so"):
                    return path
    except OSError:
        pass
    return None


def _query_symbol(path: str) -> int | None:
    try:
        lib = ctypes.CDLL(path)
        fn = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return int(fn())


def _ompi_info(path: str) -> bool | None:
    exe = os.path.join(os.path.dirname(os.path.dirname(path)), "bin", "ompi_info")
    if not os.path.exists(exe):
        return None
    try:
        out = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        if line.startswith("mca:mpi:base:param:mpi_built_with_cuda_support:value:"):
            return line.rsplit(":", 1)[-1].strip() == "true"
    return None


#: how_decided where HPCDP_CUDA_AWARE=1: device memory then goes to MPI at every size
FORCED = "forced by HPCDP_CUDA_AWARE=1"


def detect_cuda_aware(vendor: str) -> tuple[bool, str]:
    """Return ``(cuda_aware, how_decided)`` for the MPI loaded in this process."""
    setting = os.environ.get("HPCDP_CUDA_AWARE", "auto").strip().lower()
    if setting in ("1", "true", "yes"):
        return True, FORCED
    if setting in ("0", "false", "no"):
        return False, "forced by HPCDP_CUDA_AWARE=0"
    if setting != "auto":
        raise ValueError(f"HPCDP_CUDA_AWARE must be 0, 1 or auto, got {setting!r}")
    path = loaded_libmpi()
    if path is None:
        return False, "could not find the loaded libmpi in /proc/self/maps; staging (set HPCDP_CUDA_AWARE=1 to override)"
    answer = _query_symbol(path)
    if answer is not None:
        return bool(answer), f"MPIX_Query_cuda_support() returned {answer} ({path})"
    if "open mpi" in vendor.lower():
        built = _ompi_info(path)
        if built is not None:
            return built, f"ompi_info: mpi_built_with_cuda_support={str(built).lower()}"
    if "mvapich" in vendor.lower() and os.environ.get("MV2_USE_CUDA") == "1":
        return True, "MVAPICH2 with MV2_USE_CUDA=1"
    return False, (f"{path} has no MPIX_Query_cuda_support and no other probe answered; "
                   "staging (set HPCDP_CUDA_AWARE=1 if your MPI is CUDA-aware)")

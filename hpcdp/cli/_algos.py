"""Algorithm names of the allreduce benchmarks: ``hpcdp.allreduce``'s ``algo`` values, and
``two_level:<stage>``, two_level with its stage across nodes forced for that call (what
``HPCDP_ACROSS=<stage>`` does for a whole job), so that one run times the stages side by side."""
from __future__ import annotations

import functools

__all__ = ["allreduce_by"]


def allreduce_by(name: str, buf, check: bool, compression: str | None = None):
    """A no-argument call of ``hpcdp.allreduce(buf, compression=compression)`` by algorithm
    ``name``. Every rank must time the same names in the same order (the stage is set on
    each rank's runtime for the call, as the environment variable would be)."""
    import hpcdp
    from hpcdp._runtime import runtime
    from hpcdp.comm.costmodel import ACROSS
    algo, _, stage = name.partition(":")
    if not stage:
        return functools.partial(hpcdp.allreduce, buf, check=check, algo=algo, compression=compression)
    if algo != "two_level" or stage not in ACROSS:
        raise ValueError(f"{name!r}: a stage across nodes is named as two_level:<stage>, "
                         f"<stage> one of {', '.join(ACROSS)}")
    rt = runtime("allreduce()")

    def call():
        saved, rt.across = rt.across, stage
        try:
            hpcdp.allreduce(buf, check=check, algo=algo, compression=compression)
        finally:
            rt.across = saved
    return call

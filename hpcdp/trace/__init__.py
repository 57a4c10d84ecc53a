"""Tracing: every rank records timestamped events into its own HDF5 file, with
clocks aligned to rank 0; the tools (``hpcdp-trace``) and :func:`load` read them.

Usage is in ``docs/tracing.md``, the file layout in ``docs/trace-format.md``.
"""
from .clock import ClockSample, align_clocks
from .format import FORMAT_VERSION, EventKind, TraceError
from .reader import RankTrace, Trace, load
from .recorder import NullRecorder, Recorder, open_recorder
from .summary import Summary, summarize

__all__ = [
    "Recorder", "NullRecorder", "open_recorder", "EventKind", "align_clocks", "ClockSample",
    "load", "Trace", "RankTrace", "summarize", "Summary", "TraceError", "FORMAT_VERSION",
]

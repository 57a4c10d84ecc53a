"""Chrome trace-event JSON export (opens in Perfetto and chrome://tracing).

One process per rank (``pid`` = rank), two threads per process: ``tid`` 1
compute (step, forward, backward, exposed wait, optimizer) and ``tid`` 2
communication (bucket transfers, ring steps, bucket-ready instants, the
torch.distributed backend's calls and the wrappers' rows exchanges and join rounds,
named by the call). Spans
are complete events (``ph: "X"``) with ``ts``/``dur`` in microseconds from the
run's first event, in rank 0's clock. The file is streamed in batches of
events, so memory stays flat however large the run.
"""
from __future__ import annotations

import json
from typing import TextIO

from .format import EventKind
from .reader import RankTrace, Trace

__all__ = ["write_chrome", "COMPUTE_TID", "COMM_TID"]

COMPUTE_TID = 1
COMM_TID = 2
_NAMES = {EventKind.STEP: "step", EventKind.FORWARD: "forward", EventKind.BACKWARD: "backward",
          EventKind.EXPOSED_WAIT: "exposed wait", EventKind.OPTIMIZER: "optimizer"}


def write_chrome(trace: Trace, out: TextIO, steps: tuple[int, int] | None = None) -> int:
    """Write ``trace`` as Chrome trace-event JSON to ``out``; ``steps = (first, stop)``
    keeps steps ``first <= step < stop``. Returns the number of trace events."""
    out.write('{"traceEvents":[\n')
    n = 0
    for r in trace.ranks:
        pid = r.rank
        meta = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid} ({r.hostname})"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": COMPUTE_TID, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": COMM_TID,
             "args": {"name": "communication"}},
        ]
        out.write(("" if n == 0 else ",\n") + ",\n".join(json.dumps(m, separators=(",", ":")) for m in meta))
        n += len(meta)
        ev = r.events
        if steps is not None:
            ev = ev[(ev["step"] >= steps[0]) & (ev["step"] < steps[1])]
        for lo in range(0, len(ev), _BATCH):
            lines = _lines(trace.origin_ns, r, ev[lo:lo + _BATCH])
            out.write(",\n" + ",\n".join(lines))
            n += len(lines)
    other = {"run_id": trace.run_id, "world_size": trace.world_size, "level": trace.level,
             "complete": trace.complete, "meta": trace.meta}
    out.write("\n],\"displayTimeUnit\":\"ms\",\"otherData\":" + json.dumps(other, default=str) + "}\n")
    return n


_BATCH = 65536
_STEP, _READY, _COMM, _RING, _CALL = (int(k) for k in (
    EventKind.STEP, EventKind.BUCKET_READY, EventKind.BUCKET_COMM, EventKind.RING_STEP,
    EventKind.COLLECTIVE))


def _lines(origin: int, r: RankTrace, ev) -> list[str]:
    """One JSON object per event, formatted directly (names are fixed strings,
    numbers are ints and finite floats; codec names go through json.dumps)."""
    pid = r.rank
    codec = {c: json.dumps(r.codec_name(c)) for c in set(ev["codec"].tolist())}
    call = {i: json.dumps(r.call_name(i)) for i in set(ev["index"][ev["kind"] == _CALL].tolist())}
    cols = [ev[f].tolist() for f in ("kind", "step", "bucket", "index", "t0", "t1", "nbytes",
                                     "bytes_sent", "bytes_recv", "codec")]
    lines = []
    for kind, step, bucket, index, t0, t1, nbytes, sent, recv, c in zip(*cols):
        ts, dur = (t0 - origin) / 1e3, (t1 - t0) / 1e3
        if kind == _COMM:
            lines.append(f'{{"name":"bucket {bucket}","cat":"comm","ph":"X","ts":{ts},"dur":{dur},'
                         f'"pid":{pid},"tid":{COMM_TID},"args":{{"step":{step},"bucket":{bucket},'
                         f'"bytes":{nbytes},"bytes_sent":{sent},"bytes_recv":{recv},'
                         f'"compression":{codec[c]}}}}}')
        elif kind == _RING:
            lines.append(f'{{"name":"ring {bucket}.{index}","cat":"comm","ph":"X","ts":{ts},"dur":{dur},'
                         f'"pid":{pid},"tid":{COMM_TID},"args":{{"step":{step},"bucket":{bucket},'
                         f'"bytes":{nbytes},"bytes_sent":{sent},"bytes_recv":{recv},"ring_step":{index}}}}}')
        elif kind == _CALL:
            lines.append(f'{{"name":{call[index]},"cat":"comm","ph":"X","ts":{ts},"dur":{dur},'
                         f'"pid":{pid},"tid":{COMM_TID},"args":{{"step":{step},"call":{bucket},'
                         f'"bytes":{nbytes},"bytes_sent":{sent},"bytes_recv":{recv}}}}}')
        elif kind == _READY:
            lines.append(f'{{"name":"bucket {bucket} ready","cat":"comm","ph":"i","s":"t","ts":{ts},'
                         f'"pid":{pid},"tid":{COMM_TID},"args":{{"step":{step},"bucket":{bucket}}}}}')
        else:
            name = f"step {step}" if kind == _STEP else _NAMES[kind]
            lines.append(f'{{"name":"{name}","cat":"compute","ph":"X","ts":{ts},"dur":{dur},'
                         f'"pid":{pid},"tid":{COMPUTE_TID},"args":{{"step":{step}}}}}')
    return lines

"""``hpcdp-trace``: summary, chrome, plot, scaling and compare for trace runs."""
from __future__ import annotations

import argparse
import json
import math
import sys

from .chrome import write_chrome
from .format import TraceError
from .reader import load
from .summary import PHASES, _ms, _pct, format_summary, summarize

__all__ = ["main"]


def _steps(spec: str) -> tuple[int, int]:
    first, sep, stop = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        lo, hi = int(first) if first else 0, int(stop) if stop else 2**31 - 1
    except ValueError:
        raise argparse.ArgumentTypeError(f"want FIRST:STOP (e.g. 10:13), got {spec!r}") from None
    if hi <= lo:
        raise argparse.ArgumentTypeError(f"empty step range {spec!r}")
    return lo, hi


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdp-trace", description="Analyse hpcdp trace runs "
                                "(RUN = the directory given as trace=... / HPCDP_TRACE, or one rank file).")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="per phase and rank statistics, overlap, bus bandwidth, stragglers")
    s.add_argument("run")
    s.add_argument("--skip", type=int, default=0, help="leave out the first N steps (warm-up)")
    s.add_argument("--all-ranks", action="store_true", help="a row per rank even for more than 8 ranks")
    s.add_argument("--json", action="store_true", help="print the figures as JSON")
    c = sub.add_parser("chrome", help="Chrome trace-event JSON for Perfetto / chrome://tracing")
    c.add_argument("run")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--steps", type=_steps, help="FIRST:STOP, steps FIRST <= step < STOP only")
    g = sub.add_parser("plot", help="Gantt chart of a few steps across ranks (needs matplotlib)")
    g.add_argument("run")
    g.add_argument("-o", "--output", required=True, help="image file (png, svg, pdf)")
    g.add_argument("--steps", type=_steps, help="FIRST:STOP (default: the last three steps)")
    k = sub.add_parser("scaling", help="step time and efficiency over several runs (plot needs matplotlib)")
    k.add_argument("runs", nargs="+")
    k.add_argument("-o", "--output", help="image file for the scaling plot")
    k.add_argument("--skip", type=int, default=0)
    m = sub.add_parser("compare", help="two runs side by side")
    m.add_argument("a")
    m.add_argument("b")
    m.add_argument("--skip", type=int, default=0)
    m.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (TraceError, ValueError, OSError) as e:
        print(f"hpcdp-trace: error: {e}", file=sys.stderr)
        return 1


def _summary(args) -> int:
    trace = load(args.run)
    s = summarize(trace, skip=args.skip)
    if args.json:
        print(json.dumps(s.to_dict()))
        return 0
    print(format_summary(s, all_ranks=args.all_ranks))
    notes = []
    if not trace.complete:
        open_ranks = [r.rank for r in trace.ranks if not r.complete]
        notes.append(f"incomplete: rank(s) {_short(open_ranks)} did not close their file "
                     "(killed or still running); read up to each one's last flush")
    problems = trace.check()
    if problems:
        notes.append(f"{len(problems)} consistency problem(s), first: " + "; ".join(problems[:5]))
    aborted = next((r.meta["aborted"] for r in trace.ranks if "aborted" in r.meta), None)
    if aborted is not None:
        notes.append(f"rank {aborted['rank']} aborted the job: {aborted['reason']}")
    ended = {}  # signal: the ranks it ended
    for r in trace.ranks:
        if "terminated" in r.meta:
            ended.setdefault(r.meta["terminated"]["signal"], []).append(r.rank)
    for sig, ranks in ended.items():
        notes.append(f"{sig} ended rank(s) {_short(ranks)} (a time limit, scancel, preemption, or the "
                     "launcher ending the job); each wrote its trace first")
    for n in notes:
        print("note: " + n)
    return 0


def _chrome(args) -> int:
    trace = load(args.run)
    with open(args.output, "w") as out:
        n = write_chrome(trace, out, steps=args.steps)
    print(f"wrote {n} events to {args.output}")
    return 0


def _plot(args) -> int:
    from .plot import timeline_figure
    timeline_figure(load(args.run), steps=args.steps).savefig(args.output, dpi=150)
    print(f"wrote {args.output}")
    return 0


def _scaling(args) -> int:
    from .plot import scaling_figure, scaling_rows
    summaries = [summarize(load(r), skip=args.skip) for r in args.runs]
    print(f"{'ranks':>6} {'step ms':>9} {'compute':>9} {'comm':>9} {'exposed':>9} {'hidden':>8} "
          f"{'efficiency':>10}  run")
    for row in scaling_rows(summaries):
        print(f"{row['world_size']:>6} {_ms(row['step']):>9} {_ms(row['compute']):>9} "
              f"{_ms(row['communication']):>9} {_ms(row['exposed']):>9} {_pct(row['hidden_share']):>8} "
              f"{_pct(row['efficiency']):>10}  {row['path']}")
    if args.output:
        scaling_figure(summaries).savefig(args.output, dpi=150)
        print(f"wrote {args.output}")
    return 0


def _compare(args) -> int:
    a, b = (summarize(load(p), skip=args.skip) for p in (args.a, args.b))
    rows = [(f"{p} ms", a.per_step(p) / 1e6, b.per_step(p) / 1e6) for p in PHASES]
    rows += [("step p99 ms", a.stats("step")["all"]["p99"] / 1e6, b.stats("step")["all"]["p99"] / 1e6),
             ("hidden share", a.hidden_share, b.hidden_share),
             ("bus GB/s", a.busbw / 1e9, b.busbw / 1e9),
             ("payload MB/step", a.per_step("payload") / 1e6, b.per_step("payload") / 1e6),
             ("ranks", a.world_size, b.world_size),
             ("steps", len(a.steps), len(b.steps))]
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, "rows": [
            {"name": n, "a": _num(x), "b": _num(y)} for n, x, y in rows]}))
        return 0
    print(f"A = {args.a}\nB = {args.b}\n")
    print(f"{'':<16} {'A':>12} {'B':>12} {'B/A':>8}")
    for name, x, y in rows:
        ratio = y / x if x and not (math.isnan(x) or math.isnan(y)) else math.nan
        print(f"{name:<16} {_fmt(x):>12} {_fmt(y):>12} {_fmt(ratio, 3):>8}")
    return 0


def _num(x):
    return None if isinstance(x, float) and math.isnan(x) else x


def _fmt(x, digits: int = 3) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "-"
    return str(x) if isinstance(x, int) else f"{x:.{digits}f}"


def _short(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:10])) + (" ..." if len(ranks) > 10 else "")


_COMMANDS = {"summary": _summary, "chrome": _chrome, "plot": _plot, "scaling": _scaling, "compare": _compare}

if __name__ == "__main__":
    sys.exit(main())

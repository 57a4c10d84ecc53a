"""``hpcdp-bench SUBCOMMAND``: benchmarks that print JSON lines and always time
the peer in the same run. Subcommands: ``allreduce``, ``train``, ``synthetic``, ``overlap``, ``compress``,
``model`` (the cost model's predictions, no MPI) and ``calibrate`` (measure its constants)."""
from __future__ import annotations

import sys

_SUBCOMMANDS = {
    "allreduce": "hpcdp.cli.bench_allreduce",
    "train": "hpcdp.cli.bench_train",
    "overlap": "hpcdp.cli.bench_overlap",
    "compress": "hpcdp.cli.bench_compress",
    "model": "hpcdp.cli.bench_model",
    "synthetic": "hpcdp.cli.bench_synthetic",
    "calibrate": "hpcdp.cli.bench_calibrate",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _SUBCOMMANDS:
        print(f"usage: hpcdp-bench {{{','.join(_SUBCOMMANDS)}}} [options]   (-h after a subcommand for help)",
              file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(_SUBCOMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

"""``hpcdp-info`` / ``python -m hpcdp.info``: what hpcdp sees, as JSON.

Under a launcher, rank 0 prints its own view plus one line per rank
(host, local rank, device)."""
from __future__ import annotations

import json
import sys


def main(argv=None) -> int:
    import hpcdp
    hpcdp.init()
    info = hpcdp.info()
    per_rank = hpcdp.gather_object(
        {k: info[k] for k in ("rank", "hostname", "local_rank", "local_size", "device")}, root=0)
    if info["rank"] == 0:
        info["ranks"] = per_rank
        json.dump(info, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0

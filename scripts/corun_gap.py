"""Isolated versus co-run prediction gap, from one `packrat bench` run.

    python scripts/corun_gap.py bench-out/quick > docs/benchmarks/corun-gap.md

For every measured plan shape of the run (fat, the oracle's uniform shapes, packrat's),
the same profile predicts its latency twice: from the isolated figures alone (the
profile with its co-run points removed, as every profile was before co-run profiling)
and with the co-run figures (Profile.instance_latency). Both are compared with what
TorchServe measured: its worker time (mean inference minus queue time per request:
the part a profile can predict) and the client's p50 (which adds HTTP and queueing).
gap = measured / predicted - 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.corun_gap import gap_table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the `packrat bench` output directory (holds results.jsonl)")
    print(gap_table(ap.parse_args().out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

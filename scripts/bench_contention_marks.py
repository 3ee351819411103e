"""Whether the profiler tells a busy machine from a quiet one (packrat/bench/contention_marks.py):
each ARCHIVE:MODE profiled alone and beside one busy loop per core, interleaved over rounds.

    python scripts/bench_contention_marks.py --out docs/benchmarks/contention-marks-<machine> \\
        model-store/gpt2:fp32-eager model-store/noop:fp32-eager model-store/bert-base:int8s-openvino

writes <out>.md and <out>.jsonl. Archives: built ones (make run builds the demo's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.contention_marks import run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="+", help="ARCHIVE_DIR:MODE")
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--point-budget", type=float, default=2.0, help="seconds per point")
    args = ap.parse_args()
    targets = []
    for t in args.targets:
        archive, _, mode = t.rpartition(":")
        if not archive or not Path(archive).is_dir():
            ap.error(f"{t!r}: wants ARCHIVE_DIR:MODE with an archive directory")
        targets.append((Path(archive), mode))
    print(run(args.out, " ".join(["python", *sys.argv]), targets, args.rounds, args.max_batch, args.point_budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())

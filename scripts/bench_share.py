"""How long the joint division of cores takes at the issue's scale: 8 models x 64 cores x B <= 1024.

    python scripts/bench_share.py [--repeat 5] > docs/benchmarks/share-solve.json

Profiles: the Packrat authors' 16-core Xeon profiles (tests/data/packrat-icml25; ResNet-50,
Inception-v3, GPT-2), reused for 8 models with different batches, planned for 64 cores (the
optimiser reaches core counts beyond the profiled threads by running more instances).
Each repeat starts from a cold plan cache (realizable_plan is cached per profile, cores, batch).
"""

from __future__ import annotations

import argparse
import json
import sys

from packrat.bench.share_solve import time_division


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cores", type=int, default=64)
    args = ap.parse_args()
    json.dump(time_division(args.repeat, args.cores, " ".join(["scripts/bench_share.py", *sys.argv[1:]])),
              sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What reading one frontend message costs a TorchServe worker: TorchServe 0.12's parser on
the socket, the same through one buffer, and packrat.worker_messages.read_message, side by
side on the same messages, interleaved over rounds, in one process.

    python scripts/bench_worker_messages.py --out docs/benchmarks/worker-messages-<machine>

writes <out>.md and <out>.jsonl (packrat/bench/message_parse.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.message_parse import run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results path without suffix")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1000, help="reads a round for each reader and message")
    args = ap.parse_args()
    print(run(args.out, " ".join(["python", *sys.argv]), args.rounds, args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())

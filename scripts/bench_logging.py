#!/usr/bin/env python
"""TorchServe's frontend logging, built-in against packrat/log4j2.xml, side by side.

Each round starts one TorchServe per configuration (alternating, so that drift hits
both), registers the no-op archive and DistilBERT (8 tokens, batch 1, one worker x all
cores, MODE), and sends --requests requests from one closed-loop client to each. Per
point: client p50/mean/p99, the frontend JVM's CPU time per request (utime + stime of
the java process, read from /proc around the measured requests) and the bytes its
logs grew by per request. Rows go to --out as they land; --report renders the table.

    python scripts/bench_logging.py --rounds 4 --out bench-out/logging.jsonl
    python scripts/bench_logging.py --report bench-out/logging.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.logging_cost import measure, render


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="bf16-openvino")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--text-model", default="distilbert", help="e.g. tiny-distilbert for a smoke run")
    parser.add_argument("--out", type=Path, default=Path("bench-out/logging.jsonl"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    if args.report:
        print(render(args.report))
    else:
        measure(args.mode, args.rounds, args.requests, args.text_model, args.out, " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

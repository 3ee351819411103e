#!/usr/bin/env python
"""Soak: many live swaps under open-loop load, every request accounted for.

    .venv/bin/python scripts/soak_swaps.py [--swaps 100] [--rate 10] [--hold-every 2] [--max-minutes 20]

Starts TorchServe (token auth on, free loopback ports, its own slot directory)
with the sleep model (tests/data/observe/sleepmodel: each batch sleeps a table
latency and the handler claims its slot like Packrat's), sends requests at
`--rate` per second with exponential gaps (open loop: a slow answer does not
slow the senders), and swaps back to back between 2 x (1 thread, cap 2) and
1 x (2 threads, cap 4) with packrat.apply.swap.Swapper. In every
`--hold-every`-th swap away from the 2-worker shape, one worker of the
version being retired is stopped with SIGSTOP while the new version loads
(the old one still takes traffic) and resumed 3 s after the drain began: it
holds a batch unread in its socket, the case that lost requests before
(issue 14).

A request is `ok` (HTTP 200 with the model's answer), `failed` (any other
status) or `lost` (no answer within 120 s). Writes bench-out/soak/soak.json
(every swap record and every failure) and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.paths import BENCH_OUT
from packrat.bench.soak import passed, report, soak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--swaps", type=int, default=100)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second (Poisson)")
    ap.add_argument("--hold-every", type=int, default=2,
                    help="stop an old worker in every k-th swap away from the 2-worker shape (0: never)")
    ap.add_argument("--max-minutes", type=float, default=20.0, help="stop swapping after this long")
    ap.add_argument("--out", type=Path, default=BENCH_OUT / "soak")
    args = ap.parse_args()
    summary = soak(args.swaps, args.rate, args.hold_every, args.max_minutes, args.out)
    print(report(summary, f"scripts/soak_swaps.py --swaps {args.swaps} --rate {args.rate} "
                          f"--hold-every {args.hold_every}"))
    return 0 if passed(summary) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""TorchServe's own cost beside the model's: issue 15's per-request targets, in one run.

1. The no-op archive through TorchServe, one client, batch 1, fat and thin (below): the
   server's round trip.
2. DistilBERT, 8-token input, batch 1, in MODE (default bf16-openvino), in two shapes:
   fat (one worker x all cores) and thin (one 1-thread worker pinned to each core, as
   Packrat's plans run it). In process (forward only, and the handler's whole path
   `task.run`) with the shape's threads (thin: 1 thread pinned to one core), then through
   TorchServe (one client). Target, per shape: end-to-end p50 <= in-process p50 of the
   same threads + no-op p50 of the same shape + 1 ms (thin is also held against the fat
   no-op).
3. ResNet-50, B = 8, in MODE: in process (forward of a batch of 8; `task.run` of 8
   requests), then through TorchServe, fat (1 worker x all cores, batch cap 8) and thin
   (one 1-thread worker per core, cap 8 / cores), 8 closed-loop clients.
   Target: through TorchServe <= 1.25x in process.

Each TorchServe point is measured after --warm-s seconds of the same load (default 90):
TorchServe's JVM compiles its request path over its first few thousand requests, and on
a small machine its compiler threads take cores from the worker (on the 2-core EPYC,
after 100 requests C1/C2 still took 45 % of the frontend's CPU over the next 12 s; with
DistilBERT on one core, C2 took 0.85 ms of CPU per request after 20 s of load and
0.05-0.1 ms after 90 s).

In-process points are measured in a child process each (never in the process that
sends the TorchServe requests), before and after the TorchServe ones (the machine may
drift); every row goes to --out (JSONL) as it lands; --report renders the markdown.

    python scripts/bench_overhead.py --out bench-out/overhead.jsonl
    python scripts/bench_overhead.py --report bench-out/overhead.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packrat.bench.overhead import measure, render


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="bf16-openvino", help="execution mode of both models")
    parser.add_argument("--seconds", type=float, default=8.0, help="per in-process point")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per TorchServe point")
    parser.add_argument("--warm-s", type=float, default=90.0,
                        help="seconds of load before each TorchServe point (0: as before 2026-12-04, "
                             "the frontend's JIT still compiling while measured)")
    parser.add_argument("--text-model", default="distilbert", help="e.g. tiny-distilbert for a smoke run")
    parser.add_argument("--image-model", default="resnet50", help="e.g. tiny-resnet for a smoke run")
    parser.add_argument("--out", type=Path, default=Path("bench-out/overhead.jsonl"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    if args.report:
        print(render(args.report))
    else:
        measure(args.mode, args.seconds, args.requests, args.warm_s, args.text_model, args.image_model, args.out,
                " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Record TorchServe metric scrapes while a stepped closed-loop load runs.

Writes JSON lines {"t": seconds since start, "clients": level, "text": scrape}
(only the three request counters). The estimator tests replay these files
(tests/data/observe/*.jsonl), so they run on what a real TorchServe 0.12
printed, without a server.

    python scripts/record_metrics.py --metrics-url http://127.0.0.1:8082 \
        --predict-url http://127.0.0.1:8080/predictions/tiny --token KEY \
        --steps 0:3,1:6,8:8,2:6 --out tests/data/observe/steps.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from packrat.bench.loadgen import Step
from packrat.bench.record_metrics import key_headers, record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metrics-url", required=True)
    ap.add_argument("--predict-url", required=True)
    ap.add_argument("--token", default=None, help="inference key")
    ap.add_argument("--key-file", default=None,
                    help="read the inference key from this key_file.json before each request "
                         "(survives a server restart, which issues new keys)")
    ap.add_argument("--steps", required=True, help="clients:seconds,... e.g. 1:6,8:8,2:6")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    steps = [Step(int(c), float(d)) for c, d in (s.split(":") for s in args.steps.split(","))]
    recs = record(args.metrics_url, args.predict_url, key_headers(args.token, args.key_file), steps,
                  args.interval, args.out)
    bad = [r for r in recs if not r.ok]
    print(f"{len(recs)} requests, {len(bad)} failed")


if __name__ == "__main__":
    main()

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
import json
import time

import requests

from packrat.observe.metrics import METRICS_QUERY
from packrat.bench.loadgen import Step, StepLoad


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
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    steps = [Step(int(c), float(d)) for c, d in (s.split(":") for s in args.steps.split(","))]
    def headers() -> dict[str, str]:
        token = args.token
        if args.key_file:
            try:
                with open(args.key_file) as f:
                    token = json.load(f)["inference"]["key"]
            except (OSError, ValueError, KeyError):
                pass  # mid-restart: send the old key; the 401 is recorded as such
        return {"Authorization": f"Bearer {token}"} if token else {}

    load = StepLoad(args.predict_url, steps, headers=headers).start()
    t0 = load.started_s
    with open(args.out, "w") as out:
        while load.running:
            t = time.monotonic()
            try:
                text = requests.get(f"{args.metrics_url}/metrics?{METRICS_QUERY}", timeout=5).text
            except requests.RequestException as exc:
                # A restarting server: record the gap as it is.
                text = f"# scrape failed: {exc!r}"
            out.write(json.dumps({"t": round(t - t0, 3), "clients": load.level, "text": text}) + "\n")
            out.flush()
            time.sleep(max(0.0, args.interval - (time.monotonic() - t)))
    recs = load.join()
    bad = [r for r in recs if not r.ok]
    print(f"{len(recs)} requests, {len(bad)} failed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Measure live swaps: duration, phases, and p50/p99 during a swap vs steady state.

    .venv/bin/python scripts/measure_swap.py [--model minilm] [--swaps 4] [--clients 8]

Builds the model's archive into a scratch store (bench-out/swap-store), starts
TorchServe on free loopback ports (token auth on), registers it, and keeps
`clients` closed-loop clients running while the plan alternates between
2 x (1 thread) and 1 x (2 threads) `swaps` times, with `--steady` seconds of
unchanged serving between swaps. Every answer is checked against the answer
the same text got before the first swap.

Latency windows (request start times, monotonic clock):
  swap    the request overlapped [swap start, swap end]
  steady  the request lay wholly outside every swap window, after warm-up
Each plan's steady state is reported separately, since 1x2 and 2x1 differ.

Results: bench-out/swap-measure.json (raw per-swap records + summaries) and a
markdown table on stdout (pasted into docs/live-plans.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import requests

from packrat.bench.loadgen import ContinuousLoad, in_windows, latency_summary
from packrat.bench.machine import describe_machine
from packrat.server import start_torchserve
from packrat.apply.swap import SwapSettings, Swapper
from packrat.types import Instance, Plan

REPO = Path(__file__).resolve().parents[1]
THIN = Plan(cores=2, batch=4, instances=(Instance(1, 2, 0.0), Instance(1, 2, 0.0)), predicted_latency_ms=0.0)
FAT = Plan(cores=2, batch=4, instances=(Instance(2, 4, 0.0),), predicted_latency_ms=0.0)


def build(model: str, store: Path) -> None:
    from packrat.archive import build_from_dir, build_named
    from packrat.archive.local_tokenizers import minilm_dir

    if model == "minilm":
        build_from_dir(minilm_dir(), store, "minilm", reuse_current=True)
    else:
        build_named(model, store, reuse_current=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minilm", help="minilm | tiny-bert | noop | bert-base ...")
    ap.add_argument("--swaps", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steady", type=float, default=15.0, help="seconds of steady serving between swaps")
    ap.add_argument("--out", type=Path, default=REPO / "bench-out" / "swap-measure.json")
    args = ap.parse_args()

    scratch = REPO / "bench-out" / "swap-scratch"
    store = REPO / "bench-out" / "swap-store"
    store.mkdir(parents=True, exist_ok=True)
    for p in store.glob(f"{args.model}.p*"):
        shutil.rmtree(p)
    build(args.model, store)
    texts = [f"sentence {i}: the servers answer requests about weather and coffee".encode() for i in range(16)]

    server = start_torchserve(store, scratch)
    try:
        client = server.management_client()
        client.register(args.model, args.model, 1)
        url = f"{server.inference_url}/predictions/{args.model}"
        refs = [requests.post(url, data=t, headers=server.inference_headers(), timeout=120).content for t in texts]

        def same(i: int, body: bytes) -> bool:
            # Same weights in every version; thread count may move float results in the last bits.
            a, b = json.loads(body), json.loads(refs[i])
            if isinstance(a, dict) and "embedding" in a:
                a, b = a["embedding"], b["embedding"]
            if isinstance(a, list) and isinstance(b, list):
                return len(a) == len(b) and all(abs(x - y) < 1e-4 for x, y in zip(a, b))
            if isinstance(a, dict) and "scores" in a:
                return a.get("label") == b.get("label")
            return a == b

        swapper = Swapper(client, store, cores=[0, 1], settings=SwapSettings())
        # Get off the plain version first (not measured: it is a different starting shape).
        swapper.apply(args.model, FAT)
        load = ContinuousLoad(url=url, headers=server.inference_headers(), bodies=texts, check=same,
                              clients=args.clients).start()
        t_begin = time.monotonic()
        time.sleep(args.steady)
        windows, records, plan_spans = [], [], []  # plan_spans: (start, end, plan name)
        current, since = "1x2", t_begin + 3.0  # skip 3 s of warm-up
        for k in range(args.swaps):
            target, name = (THIN, "2x1") if k % 2 == 0 else (FAT, "1x2")
            a = time.monotonic()
            rec = swapper.apply(args.model, target)
            b = time.monotonic()
            plan_spans.append((since, a, current))
            windows.append((a, b))
            records.append(rec.to_dict())
            print(f"swap {k + 1}: -> {name} {rec.duration_s:.1f}s {rec.phases_s}", file=sys.stderr)
            current, since = name, b
            time.sleep(args.steady)
        plan_spans.append((since, time.monotonic(), current))
        samples = load.stop()
    finally:
        server.stop()

    during = in_windows(samples, windows)
    during_ids = {id(s) for s in during}
    steady = {}
    for name in ("1x2", "2x1"):
        spans = [(a, b) for a, b, n in plan_spans if n == name]
        chosen = [s for s in in_windows(samples, spans) if id(s) not in during_ids]
        steady[name] = latency_summary(chosen, digits=2)
    result = {
        "model": args.model,
        "clients": args.clients,
        "swaps": records,
        "during_swaps": latency_summary(during, digits=2),
        "steady": steady,
        "all": latency_summary(samples, digits=2),
        # Raw samples: start (s since the load began), latency (ms), ok; for plots and re-analysis.
        "samples": [[round(x.start - t_begin, 3), round(x.latency_s * 1000, 2), x.ok] for x in samples],
        "swap_windows": [[round(a - t_begin, 3), round(b - t_begin, 3)] for a, b in windows],
        "machine": describe_machine().as_dict(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"\nModel `{args.model}`, {args.clients} closed-loop clients, {result['machine']['cpu']}, "
          f"{result['when']}\n")
    print("| swap | to | duration s | workers start (register + READY and pinned) s | drain s | retire s |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(records, 1):
        p = r["phases_s"]
        shape = " + ".join(f"{x['threads']}t" for x in r["plan"]["instances"])
        start = p.get("register", 0) + p.get("ready", 0)
        print(f"| {i} | {shape} | {r['duration_s']:.1f} | {start:.1f} | {p.get('drain', 0):.2f} "
              f"| {p.get('retire', p.get('unregister', 0)):.2f} |")
    print("\n| window | requests | failed | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for label, s in [("steady 1x(2 threads)", steady["1x2"]), ("steady 2x(1 thread)", steady["2x1"]),
                     ("during swaps", result["during_swaps"])]:
        print(f"| {label} | {s['requests']} | {s['failed']} | {s['p50_ms']} | {s['p99_ms']} | {s['max_ms']} |")
    return 0 if result["all"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

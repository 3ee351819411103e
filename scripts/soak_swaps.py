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
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from packrat.apply.swap import Swapper
from packrat.bench.loadgen import PoissonLoad
from packrat.bench.machine import describe_machine
from packrat.bench.sleepmodel import copy_sleep_model
from packrat.server import start_torchserve
from packrat.types import Instance, Plan

REPO = Path(__file__).resolve().parents[1]

MODEL = "soak"
THIN = Plan(cores=2, batch=4, instances=(Instance(1, 2, 0.0), Instance(1, 2, 0.0)), predicted_latency_ms=0.0)
FAT = Plan(cores=2, batch=4, instances=(Instance(2, 4, 0.0),), predicted_latency_ms=0.0)
HOLD_S = 3.0


def answered(i: int, data: bytes) -> bool:
    """The sleep model answers each request with the batch it was served in."""
    return "batch" in json.loads(data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--swaps", type=int, default=100)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second (Poisson)")
    ap.add_argument("--hold-every", type=int, default=2,
                    help="stop an old worker in every k-th swap away from the 2-worker shape (0: never)")
    ap.add_argument("--max-minutes", type=float, default=20.0, help="stop swapping after this long")
    ap.add_argument("--out", type=Path, default=REPO / "bench-out" / "soak")
    args = ap.parse_args()

    shutil.rmtree(args.out, ignore_errors=True)
    store = args.out / "store"
    store.mkdir(parents=True)
    copy_sleep_model(store, MODEL)
    slot_dir = args.out / "slots"
    os.environ["PACKRAT_SLOT_DIR"] = str(slot_dir)  # this process reads the workers' status files
    server = start_torchserve(store, args.out / "ts", slot_dir=slot_dir)
    records, holds = [], []
    t_begin = time.time()
    try:
        client = server.management_client()
        server.register(MODEL)
        swapper = Swapper(client, store, cores=[0, 1])
        swapper.apply(MODEL, THIN)  # start from a Packrat version
        load = PoissonLoad(f"{server.inference_url}/predictions/{MODEL}", server.inference_headers, args.rate,
                           body=lambda i: f"soak {i}".encode(), check=answered).start()
        time.sleep(2.0)
        deadline = time.monotonic() + args.max_minutes * 60
        for k in range(args.swaps):
            if time.monotonic() > deadline:
                print(f"stopping after {k} swaps: --max-minutes reached", file=sys.stderr)
                break
            plan = FAT if k % 2 == 0 else THIN
            # Only swaps away from the 2-worker shape: with the only worker of the serving
            # version stopped, TorchServe's job queue (100) fills at this rate in 10 s and
            # it answers 503: the fault injected, not the swap (first run, reliability.md).
            hold = (args.hold_every > 0 and plan is FAT
                    and (k // 2) % args.hold_every == args.hold_every - 1)
            old_pids = [w["pid"] for w in client.describe(MODEL)["workers"]]

            held: list[int] = []

            def on_phase(rec, hold=hold, old_pids=old_pids, held=held) -> None:
                # Stopped while the old version still takes traffic (the new one loads),
                # so it is handed a batch it does not read; resumed once the drain waited.
                if hold and rec.phase == "ready" and old_pids:
                    held.append(random.Random(k).choice(old_pids))
                    os.kill(held[0], signal.SIGSTOP)
                    holds.append({"swap": k, "pid": held[0]})
                if held and rec.phase == "drain":
                    threading.Timer(HOLD_S, _resume, (held[0],)).start()

            try:
                rec = swapper.apply(MODEL, plan, on_phase=on_phase).to_dict()
            except Exception as exc:  # noqa: BLE001 - a failed swap is a result too
                rec = {"outcome": "error", "error": repr(exc)}
            finally:
                for pid in held:
                    _resume(pid)  # never leave a stopped worker behind (a failed swap)
            rec["k"] = k
            records.append(rec)
            print(f"swap {k + 1}: {rec.get('outcome')} {rec.get('duration_s')} s {rec.get('phases_s')} "
                  f"{rec.get('warnings') or ''}", file=sys.stderr)
        time.sleep(2.0)
        results = load.stop()
    finally:
        server.stop()
    elapsed = time.time() - t_begin
    by = {o: [r for r in results if r["outcome"] == o] for o in ("ok", "failed", "lost")}
    swaps_ok = sum(r.get("outcome") == "applied" for r in records)
    durations = sorted(r["duration_s"] for r in records if r.get("duration_s"))
    summary = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_begin)),
        "cpu": describe_machine().cpu, "cores": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
        "elapsed_s": round(elapsed, 1), "swaps": len(records), "swaps_applied": swaps_ok,
        "held_batches": len(holds), "rate_per_s": args.rate,
        "requests": len(results), "ok": len(by["ok"]), "failed": len(by["failed"]), "lost": len(by["lost"]),
        "swap_s_p50": durations[len(durations) // 2] if durations else None,
        "swap_s_max": durations[-1] if durations else None,
        "returned_jobs": sum(1 for r in records for w in r.get("warnings", []) if "came back" in w),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(
        {"summary": summary, "swaps": records, "holds": holds,
         "not_ok": by["failed"] + by["lost"]}, indent=1) + "\n")
    print(f"\n`scripts/soak_swaps.py --swaps {args.swaps} --rate {args.rate} --hold-every {args.hold_every}` "
          f"on {summary['cpu']} ({summary['cores']} cores), {summary['when']}, {elapsed / 60:.1f} min\n")
    print("| swaps applied | batches held (SIGSTOP) | requests | ok | failed | lost | swap p50 s | swap max s |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {swaps_ok} / {len(records)} | {len(holds)} | {len(results)} | {len(by['ok'])} | {len(by['failed'])} "
          f"| {len(by['lost'])} | {summary['swap_s_p50']} | {summary['swap_s_max']} |")
    return 0 if not by["failed"] and not by["lost"] and swaps_ok == len(records) else 1


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())

"""Soak: many live swaps under open-loop load, every request accounted for
(scripts/soak_swaps.py says what is run).

The sleep model on its own TorchServe; swaps back to back between thin and fat while a
Poisson load runs; in every k-th swap away from the 2-worker shape one worker of the
retiring version is stopped (SIGSTOP) while the new version loads and resumed 3 s into the
drain, so it holds a batch unread in its socket.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from packrat.apply.client import ManagementClient
from packrat.apply.swap import Swapper
from packrat.bench.loadgen import PoissonLoad
from packrat.bench.machine import describe_machine
from packrat.bench.sleepmodel import copy_sleep_model
from packrat.bench.swap_shapes import thin_and_fat
from packrat.server import start_torchserve
from packrat import settings

MODEL = "soak"
THIN, FAT = thin_and_fat()
HOLD_S = 3.0


def answered(i: int, data: bytes) -> bool:
    """The sleep model answers each request with the batch it was served in."""
    return "batch" in json.loads(data)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _one_swap(swapper: Swapper, client: ManagementClient, k: int, hold: bool, holds: list[dict]) -> dict:
    """Swap k (to fat when k is even); with `hold`, one old worker held while the new one loads."""
    plan = FAT if k % 2 == 0 else THIN
    old_pids = [w["pid"] for w in client.describe(MODEL)["workers"]]
    held: list[int] = []

    def on_phase(rec: Any) -> None:
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
    return rec


def soak(swaps: int, rate: float, hold_every: int, max_minutes: float, out: Path) -> dict:
    """Run the soak in `out` (emptied first); write out/soak.json; return its summary."""
    shutil.rmtree(out, ignore_errors=True)
    store = out / "store"
    store.mkdir(parents=True)
    copy_sleep_model(store, MODEL)
    slot_dir = out / "slots"
    os.environ[settings.get("slot_dir").env] = str(slot_dir)  # this process reads the workers' status files
    server = start_torchserve(store, out / "ts", slot_dir=slot_dir)
    records: list[dict] = []
    holds: list[dict] = []
    t_begin = time.time()
    try:
        client = server.management_client()
        server.register(MODEL)
        swapper = Swapper(client, store, cores=[0, 1])
        swapper.apply(MODEL, THIN)  # start from a Packrat version
        load = PoissonLoad(f"{server.inference_url}/predictions/{MODEL}", server.inference_headers, rate,
                           body=lambda i: f"soak {i}".encode(), check=answered).start()
        time.sleep(2.0)
        deadline = time.monotonic() + max_minutes * 60
        for k in range(swaps):
            if time.monotonic() > deadline:
                print(f"stopping after {k} swaps: --max-minutes reached", file=sys.stderr)
                break
            # Only swaps away from the 2-worker shape: with the only worker of the serving
            # version stopped, TorchServe's job queue (100) fills at this rate in 10 s and
            # it answers 503: the fault injected, not the swap (first run, reliability.md).
            hold = hold_every > 0 and k % 2 == 0 and (k // 2) % hold_every == hold_every - 1
            rec = _one_swap(swapper, client, k, hold, holds)
            records.append(rec)
            print(f"swap {k + 1}: {rec.get('outcome')} {rec.get('duration_s')} s {rec.get('phases_s')} "
                  f"{rec.get('warnings') or ''}", file=sys.stderr)
        time.sleep(2.0)
        results = load.stop()
    finally:
        server.stop()
    return _write(out, t_begin, rate, records, holds, results)


def _write(out: Path, t_begin: float, rate: float, records: list[dict], holds: list[dict],
           results: list[dict]) -> dict:
    by = {o: [r for r in results if r["outcome"] == o] for o in ("ok", "failed", "lost")}
    durations = sorted(r["duration_s"] for r in records if r.get("duration_s"))
    summary = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_begin)),
        "cpu": describe_machine().label, "cores": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
        "elapsed_s": round(time.time() - t_begin, 1), "swaps": len(records),
        "swaps_applied": sum(r.get("outcome") == "applied" for r in records),
        "held_batches": len(holds), "rate_per_s": rate,
        "requests": len(results), "ok": len(by["ok"]), "failed": len(by["failed"]), "lost": len(by["lost"]),
        "swap_s_p50": durations[len(durations) // 2] if durations else None,
        "swap_s_max": durations[-1] if durations else None,
        "returned_jobs": sum(1 for r in records for w in r.get("warnings", []) if "came back" in w),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(
        {"summary": summary, "swaps": records, "holds": holds,
         "not_ok": by["failed"] + by["lost"]}, indent=1) + "\n")
    return summary


def report(summary: dict, command: str) -> str:
    s = summary
    return (f"\n`{command}` on {s['cpu']} ({s['cores']} cores), {s['when']}, {s['elapsed_s'] / 60:.1f} min\n\n"
            "| swaps applied | batches held (SIGSTOP) | requests | ok | failed | lost | swap p50 s | swap max s |\n"
            "|---|---|---|---|---|---|---|---|\n"
            f"| {s['swaps_applied']} / {s['swaps']} | {s['held_batches']} | {s['requests']} | {s['ok']} | {s['failed']} "
            f"| {s['lost']} | {s['swap_s_p50']} | {s['swap_s_max']} |")


def passed(summary: dict) -> bool:
    """No request failed or lost, every swap applied."""
    return not summary["failed"] and not summary["lost"] and summary["swaps_applied"] == summary["swaps"]

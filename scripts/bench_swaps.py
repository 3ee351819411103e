#!/usr/bin/env python
"""Swap times and latency during swaps, per model and execution mode, cold and warm cache.

    .venv/bin/python scripts/bench_swaps.py [--models resnet50,bert-base]
        [--modes fp32-eager,bf16-openvino] [--swaps 5] [--clients 8] [--steady 8]

Builds the full-size demo archives (seeded random weights, as `packrat archive`
does) into bench-out/swaps-store, starts one TorchServe on free loopback ports
(token auth on) and, per model, registers the plain archive (1 worker), then per
mode, with `clients` closed-loop clients sending requests throughout:

  cold   the build cache (bench-out/swaps-store/.packrat-build-cache) is emptied,
         then a swap into the mode as 2 x (1 thread): it exports, compiles, guards
  cold2  a swap to 1 x (2 threads): the ONNX file and the guard verdict are cached,
         OpenVINO's compiled blob for 2 threads is not yet
  warm   `swaps` swaps alternating 2 x (1 thread) <-> 1 x (2 threads), everything cached,
         with `steady` seconds of unchanged serving before and between them

A swap's time is reported two ways: `live_s`, from the apply call until
set-default made the new version live (how the issue times a swap), and
`duration_s`, until the old version is drained and unregistered. Latency windows:
a request overlapping a warm swap's [start, end] counts as "during swaps", one
wholly outside every swap (and 3 s after the mode went live) as "steady".
Every answer is checked (label or top class the same as before the swaps).

Workers start through the fork server (packrat/forkserver) unless PACKRAT_FORKSERVER=0.

Writes docs/benchmarks/swaps.json (or --out): machine, command, load average
before and after, per (model, mode) the swap records and the summaries; prints a
markdown table (pasted into docs/live-plans.md).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

from packrat import forkserver
from packrat.apply.swap import SwapSettings, Swapper
from packrat.bench.handler_code import handler_module
from packrat.bench.loadgen import ContinuousLoad, in_windows, latency_summary
from packrat.bench.machine import describe_machine
from packrat.server import start_torchserve
from packrat.types import Instance, Plan

REPO = Path(__file__).resolve().parents[1]
TARGET_P50_S, TARGET_MAX_S, TARGET_P99_RATIO = 5.0, 8.0, 1.5


def plans(mode: str) -> tuple[Plan, Plan]:
    thin = Plan(cores=2, batch=4, instances=(Instance(1, 2, 0.0), Instance(1, 2, 0.0)),
                predicted_latency_ms=0.0, mode=mode)
    fat = Plan(cores=2, batch=4, instances=(Instance(2, 4, 0.0),), predicted_latency_ms=0.0, mode=mode)
    return thin, fat


def bodies(model: str) -> list[bytes]:
    if model.startswith("resnet"):
        sample_jpeg = handler_module("packrat_tasks.samples").sample_jpeg
        return [sample_jpeg(320, 240, seed=i) for i in range(8)]
    return [f"request {i}: the servers answer questions about weather, travel and coffee".encode()
            for i in range(16)]


def top(body: bytes) -> str | None:
    """The label an answer names first (text classification: `label`; image: the first of
    `predictions`, handlers/packrat_tasks/image.py)."""
    a = json.loads(body)
    if isinstance(a, dict) and "label" in a:
        return a["label"]
    if isinstance(a, dict) and a.get("predictions"):
        return a["predictions"][0].get("label")
    return str(a)


def med(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def phase_medians(records: list[dict]) -> dict[str, float | None]:
    names: list[str] = []
    for r in records:
        for k in list(r["phases_s"]) + list(r.get("ready_phases_s") or {}):
            if k not in names:
                names.append(k)
    out = {}
    for k in names:
        vals = [r["phases_s"][k] if k in r["phases_s"] else (r.get("ready_phases_s") or {}).get(k)
                for r in records]
        out[k] = med([v for v in vals if v is not None])
    return out


class CpuSampler(threading.Thread):
    """CPU ticks of every process, 10 times a second: who got the cores while a swap ran."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, dict[int, int]]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            now, ticks = time.monotonic(), {}
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        stat = Path(f"/proc/{entry}/stat").read_text()
                        fields = stat[stat.rindex(")") + 2:].split()
                        ticks[int(entry)] = int(fields[11]) + int(fields[12])  # utime + stime
                    except (OSError, ValueError, IndexError):
                        pass
            self.samples.append((now, ticks))
            self._done.wait(0.1)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def cores(self, a: float, b: float, pids: set[int] | None) -> float | None:
        """Cores used over [a, b] by `pids` (None: every process)."""
        times = [t for t, _ in self.samples]
        i, j = bisect.bisect_left(times, a), bisect.bisect_left(times, b)
        if j >= len(times) or i >= j:
            return None
        (ta, ra), (tb, rb) = self.samples[i], self.samples[j]
        used = sum(v - ra.get(pid, 0) for pid, v in rb.items() if pids is None or pid in pids)
        return round(used / os.sysconf("SC_CLK_TCK") / (tb - ta), 2)


def cpu_split(sampler: CpuSampler, samples: list, swaps: list[tuple[float, float, dict]],
              old_pids: list[set[int]]) -> list[dict]:
    """Per warm swap: cores used by the serving (old) workers, the new ones and everything
    else, in the 2 s before and while the new version loaded; and how much slower the
    requests that overlapped the loading were than those just before."""
    rows = []
    for (a, live, rec), old in zip(swaps, old_pids):
        new = {w["pid"] for w in rec["workers"]}
        before = [x.latency_s for x in samples if a - 3.0 < x.start and x.start + x.latency_s < a and x.ok]
        loading = [x.latency_s for x in samples if x.start < live and x.start + x.latency_s > a and x.ok]
        row = {"to": "thin" if len(rec["plan"]["instances"]) > 1 else "fat", "live_s": rec["live_s"]}
        for name, (x, y) in (("before", (a - 2.0, a)), ("loading", (a, live))):
            total, serving, loaders = (sampler.cores(x, y, pids) for pids in (None, old, new))
            row[name] = {"all": total, "serving": serving, "new": loaders}
        if before and loading:
            ref = statistics.median(before)
            row["loading_mean_vs_before"] = round(statistics.mean(loading) / ref, 2)
            row["loading_max_vs_before"] = round(max(loading) / ref, 2)
        rows.append(row)
    return rows


def run_mode(server, swapper: Swapper, model: str, mode: str, store: Path, args) -> dict:
    url = f"{server.inference_url}/predictions/{model}"
    thin, fat = plans(mode)
    shutil.rmtree(store / ".packrat-build-cache", ignore_errors=True)  # cold: nothing built yet
    data = bodies(model)
    refs = [top(requests.post(url, data=b, headers=server.inference_headers(), timeout=300).content) for b in data]
    changed: list[int] = []

    def same(i: int, body: bytes) -> bool:
        # A well-formed answer passes; its top label is compared and a change counted, not
        # failed: bf16 may flip a near-tie of the seeded random models (the guard bounds it).
        if top(body) != refs[i]:
            changed.append(i)
        return True

    sampler = CpuSampler()
    sampler.start()
    load = ContinuousLoad(url=url, headers=server.inference_headers(), bodies=data, check=same,
                          clients=args.clients).start()
    time.sleep(3.0)
    records: dict[str, list[dict]] = {"cold": [], "cold2": [], "warm": []}
    windows, loading, draining = [], [], []
    warm_starts: list[tuple[float, float, dict]] = []
    for label, plan in (("cold", thin), ("cold2", fat)):
        rec = swapper.apply(model, plan)
        records[label].append(rec.to_dict())
        print(f"  {label}: live {rec.live_s:.2f}s total {rec.duration_s:.2f}s "
              f"ready {dict(rec.ready_phases_s)} cache {[w['cache'] for w in rec.workers]}", file=sys.stderr)
    live_since = time.monotonic()
    time.sleep(args.steady)
    for k in range(args.swaps):
        plan = thin if k % 2 == 0 else fat
        a = time.monotonic()
        rec = swapper.apply(model, plan)
        windows.append((a, time.monotonic()))
        loading.append((a, a + rec.live_s))  # until the new version serves
        draining.append((a + rec.live_s, windows[-1][1]))
        records["warm"].append(rec.to_dict())
        warm_starts.append((a, a + rec.live_s, records["warm"][-1]))
        print(f"  warm {k + 1}: live {rec.live_s:.2f}s total {rec.duration_s:.2f}s "
              f"phases {dict(rec.phases_s)} ready {dict(rec.ready_phases_s)}", file=sys.stderr)
        time.sleep(args.steady)
    samples = load.stop()
    sampler.stop()
    every = records["cold"] + records["cold2"] + records["warm"]
    serving_pids = [{w["pid"] for w in r["workers"]} for r in every][1:-1]  # each warm swap's old version
    after = [s for s in samples if s.start >= live_since + 3.0]
    during = in_windows(after, windows)
    during_ids = {id(s) for s in during}
    steady = [s for s in after if id(s) not in during_ids]
    warm = records["warm"]
    live = [r["live_s"] for r in warm]
    total = [r["duration_s"] for r in warm]
    summary = {
        "warm_live_s": {"p50": med(live), "max": max(live) if live else None, "all": live},
        "warm_total_s": {"p50": med(total), "max": max(total) if total else None, "all": total},
        "cold_live_s": [r["live_s"] for r in records["cold"] + records["cold2"]],
        "cold_total_s": [r["duration_s"] for r in records["cold"] + records["cold2"]],
        "warm_phase_medians_s": phase_medians(warm),
        "cold_phases_s": [{**r["phases_s"], **(r.get("ready_phases_s") or {})}
                          for r in records["cold"] + records["cold2"]],
        "cold_cache": [[w["cache"] for w in r["workers"]] for r in records["cold"] + records["cold2"]],
        "warm_cache": [[w["cache"] for w in r["workers"]] for r in warm],
        "steady": latency_summary(steady),
        "during_swaps": latency_summary(during),
        # The same requests by what they overlapped: the new version loading beside the old
        # one, or after it went live (the old one draining, the new one's first batches).
        "during_loading": latency_summary(in_windows(after, loading)),
        "during_draining": latency_summary(in_windows(after, draining)),
        "load_nice": os.environ.get("PACKRAT_LOAD_NICE"),
        "all_requests": latency_summary(samples),
        "reference_labels": refs,
        "answers_with_another_top_label": len(changed),
        "cpu_split": cpu_split(sampler, after, warm_starts, serving_pids[-len(warm_starts):]),
    }
    s, d = summary["steady"]["p99_ms"], summary["during_swaps"]["p99_ms"]
    summary["p99_ratio"] = round(d / s, 2) if s else None
    return {"model": model, "mode": mode, "records": records, "summary": summary}


def verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return "met" if value <= target else f"missed by {value - target:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-base")
    ap.add_argument("--modes", default="fp32-eager,bf16-openvino")
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steady", type=float, default=8.0, help="seconds of steady serving before/between swaps")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "swaps.json")
    args = ap.parse_args()

    from packrat.archive import build_named

    store = REPO / "bench-out" / "swaps-store"
    store.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    for m in models:
        for p in store.glob(f"{m}.p*"):
            shutil.rmtree(p)
        build_named(m, store, reuse_current=True)  # a stale handler copy would measure old code
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": describe_machine().as_dict(),
              "command": "scripts/bench_swaps.py " + " ".join(sys.argv[1:]),
              "loadavg_before": os.getloadavg(), "clients": args.clients, "swaps": args.swaps,
              "steady_s": args.steady, "forkserver": forkserver.enabled(), "runs": []}
    server = start_torchserve(store, REPO / "bench-out" / "swaps-ts", slot_dir=REPO / "bench-out" / "swaps-slots")
    os.environ["PACKRAT_SLOT_DIR"] = str(server.slot_dir)  # the Swapper reads the workers' status files
    try:
        client = server.management_client()
        swapper = Swapper(client, store, cores=[0, 1], settings=SwapSettings())
        for m in models:
            client.register(m, m, 1)
            for mode in args.modes.split(","):
                print(f"{m} {mode}", file=sys.stderr)
                run = run_mode(server, swapper, m, mode, store, args)
                run["loadavg_after"] = os.getloadavg()
                result["runs"].append(run)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")  # partial results survive a crash
            client.unregister(m, client.describe(m)["modelVersion"])
    finally:
        server.stop()
    result["loadavg_after"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    mach = result["machine"]
    print(f"\n{mach.get('cpu')} ({', '.join(mach.get('flags', []))}), {mach['cpus']} CPUs, {result['when']}, "
          f"load average before {tuple(round(x, 2) for x in result['loadavg_before'])}, "
          f"after {tuple(round(x, 2) for x in result['loadavg_after'])}, workers "
          f"{'forked by the fork server' if result['forkserver'] else 'started cold (PACKRAT_FORKSERVER=0)'}\n")
    print("| model | mode | warm live p50 / max s | warm total p50 / max s | cold live s (1st, 2nd) "
          "| steady p99 ms | during-swap p99 ms | ratio | live p50 <= 5 s | live max <= 8 s | p99 <= 1.5x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in result["runs"]:
        s = run["summary"]
        print(f"| {run['model']} | {run['mode']} | {s['warm_live_s']['p50']} / {s['warm_live_s']['max']} "
              f"| {s['warm_total_s']['p50']} / {s['warm_total_s']['max']} "
              f"| {', '.join(str(x) for x in s['cold_live_s'])} | {s['steady']['p99_ms']} "
              f"| {s['during_swaps']['p99_ms']} | {s['p99_ratio']} "
              f"| {verdict(s['warm_live_s']['p50'], TARGET_P50_S)} | {verdict(s['warm_live_s']['max'], TARGET_MAX_S)} "
              f"| {verdict(s['p99_ratio'], TARGET_P99_RATIO)} |")
    print("\np99 ms of the requests during warm swaps, by what each overlapped:\n")
    print("| model | mode | steady | during swaps | while the new version loads | after it is live (drain) |")
    print("|---|---|---|---|---|---|")
    for run in result["runs"]:
        s = run["summary"]
        print(f"| {run['model']} | {run['mode']} | {s['steady']['p99_ms']} | {s['during_swaps']['p99_ms']} "
              f"| {s['during_loading']['p99_ms']} | {s['during_draining']['p99_ms']} |")
    print("\nWarm swaps, median seconds per phase:\n")
    names = []
    for run in result["runs"]:
        names += [k for k in run["summary"]["warm_phase_medians_s"] if k not in names]
    print("| model | mode | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for run in result["runs"]:
        ph = run["summary"]["warm_phase_medians_s"]
        print(f"| {run['model']} | {run['mode']} | " + " | ".join(str(ph.get(k, "")) for k in names) + " |")
    print("\nWho had the cores, warm swaps by direction (medians): cores used by the serving (old) "
          "workers and the new ones in the 2 s before and while the new version loaded; requests "
          "that overlapped the loading against the median of those in the 3 s before:\n")
    print("| model | mode | to | swaps | serving before | serving / new / all while loading "
          "| loading mean / max vs before |")
    print("|---|---|---|---:|---:|---|---|")
    for run in result["runs"]:
        for to in ("thin", "fat"):
            rows = [r for r in run["summary"]["cpu_split"] if r["to"] == to and "loading_mean_vs_before" in r]
            if not rows:
                continue

            def m(get):
                vals = [v for v in (get(r) for r in rows) if v is not None]
                return med(vals) if vals else "n/a"
            print(f"| {run['model']} | {run['mode']} | {to} | {len(rows)} | {m(lambda r: r['before']['serving'])} "
                  f"| {m(lambda r: r['loading']['serving'])} / {m(lambda r: r['loading']['new'])} / "
                  f"{m(lambda r: r['loading']['all'])} | {m(lambda r: r['loading_mean_vs_before'])} / "
                  f"{m(lambda r: r['loading_max_vs_before'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

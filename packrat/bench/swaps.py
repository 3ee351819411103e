"""Swap times and latency during swaps, per model and execution mode, cold and warm cache
(scripts/bench_swaps.py says what is measured).

One TorchServe on loopback; per model the plain archive, then per mode a cold swap (build
cache emptied), a second cold one, and warm swaps alternating thin <-> fat under a closed
load, every answer checked. The result is one JSON document; report() renders its tables.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from packrat import forkserver
from packrat.apply.client import session_for
from packrat.apply.swap import SwapSettings, Swapper
from packrat.bench.handler_code import handler_module
from packrat.bench.loadgen import ContinuousLoad, Sample, in_windows, latency_summary
from packrat.bench.machine import describe_machine
from packrat.bench.paths import BENCH_OUT
from packrat.bench.proc_cpu import all_cpu_ticks
from packrat.bench.swap_shapes import thin_and_fat
from packrat.server import RunningServer, start_torchserve
from packrat.types import Plan
from packrat import settings

TARGET_P50_S, TARGET_MAX_S, TARGET_P99_RATIO = 5.0, 8.0, 1.5


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
            now = time.monotonic()
            self.samples.append((now, all_cpu_ticks()))
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


@dataclass
class _Swaps:
    """What the swaps of one (model, mode) did, and when (monotonic clock)."""

    records: dict[str, list[dict]] = field(default_factory=lambda: {"cold": [], "cold2": [], "warm": []})
    windows: list[tuple[float, float]] = field(default_factory=list)  # each warm swap's [start, end]
    loading: list[tuple[float, float]] = field(default_factory=list)  # until the new version serves
    draining: list[tuple[float, float]] = field(default_factory=list)
    warm_starts: list[tuple[float, float, dict]] = field(default_factory=list)
    live_since: float = 0.0


def _swap(swapper: Swapper, model: str, thin: Plan, fat: Plan, swaps: int, steady_s: float) -> _Swaps:
    done = _Swaps()
    for label, plan in (("cold", thin), ("cold2", fat)):
        rec = swapper.apply(model, plan)
        done.records[label].append(rec.to_dict())
        print(f"  {label}: live {rec.live_s:.2f}s total {rec.duration_s:.2f}s "
              f"ready {dict(rec.ready_phases_s)} cache {[w['cache'] for w in rec.workers]}", file=sys.stderr)
    done.live_since = time.monotonic()
    time.sleep(steady_s)
    for k in range(swaps):
        plan = thin if k % 2 == 0 else fat
        a = time.monotonic()
        rec = swapper.apply(model, plan)
        done.windows.append((a, time.monotonic()))
        done.loading.append((a, a + rec.live_s))  # until the new version serves
        done.draining.append((a + rec.live_s, done.windows[-1][1]))
        done.records["warm"].append(rec.to_dict())
        done.warm_starts.append((a, a + rec.live_s, done.records["warm"][-1]))
        print(f"  warm {k + 1}: live {rec.live_s:.2f}s total {rec.duration_s:.2f}s "
              f"phases {dict(rec.phases_s)} ready {dict(rec.ready_phases_s)}", file=sys.stderr)
        time.sleep(steady_s)
    return done


def run_mode(server: RunningServer, swapper: Swapper, model: str, mode: str, store: Path, clients: int,
             swaps: int, steady_s: float) -> dict:
    url = f"{server.inference_url}/predictions/{model}"
    thin, fat = thin_and_fat(mode)
    shutil.rmtree(store / ".packrat-build-cache", ignore_errors=True)  # cold: nothing built yet
    data = bodies(model)
    with session_for(url) as direct:  # never via a proxy: the key
        refs = [top(direct.post(url, data=b, headers=server.inference_headers(), timeout=300).content) for b in data]
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
                          clients=clients).start()
    time.sleep(3.0)
    done = _swap(swapper, model, thin, fat, swaps, steady_s)
    samples = load.stop()
    sampler.stop()
    summary = _summary(done, samples, sampler, refs, len(changed))
    s, d = summary["steady"]["p99_ms"], summary["during_swaps"]["p99_ms"]
    summary["p99_ratio"] = round(d / s, 2) if s else None
    return {"model": model, "mode": mode, "records": done.records, "summary": summary}


def _summary(done: _Swaps, samples: list[Sample], sampler: CpuSampler, refs: list[str | None],
             changed: int) -> dict:
    records = done.records
    every = records["cold"] + records["cold2"] + records["warm"]
    serving_pids = [{w["pid"] for w in r["workers"]} for r in every][1:-1]  # each warm swap's old version
    after = [s for s in samples if s.start >= done.live_since + 3.0]
    during = in_windows(after, done.windows)
    during_ids = {id(s) for s in during}
    steady = [s for s in after if id(s) not in during_ids]
    warm = records["warm"]
    live = [r["live_s"] for r in warm]
    total = [r["duration_s"] for r in warm]
    return {
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
        "during_loading": latency_summary(in_windows(after, done.loading)),
        "during_draining": latency_summary(in_windows(after, done.draining)),
        "load_nice": settings.value("load_nice"),
        "all_requests": latency_summary(samples),
        "reference_labels": refs,
        "answers_with_another_top_label": changed,
        "cpu_split": cpu_split(sampler, after, done.warm_starts, serving_pids[-len(done.warm_starts):]),
    }


def verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return "met" if value <= target else f"missed by {value - target:.2f}"


def measure_swaps(models: list[str], modes: list[str], swaps: int, clients: int, steady_s: float, out: Path,
                  command: str) -> dict:
    """Every (model, mode) on one TorchServe; the result is rewritten to `out` after each
    (partial results survive a crash)."""
    from packrat.archive import build_named

    store = BENCH_OUT / "swaps-store"
    store.mkdir(parents=True, exist_ok=True)
    for m in models:
        for p in store.glob(f"{m}.p*"):
            shutil.rmtree(p)
        build_named(m, store, reuse_current=True)  # a stale handler copy would measure old code
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": describe_machine().as_dict(),
              "command": command, "loadavg_before": os.getloadavg(), "clients": clients, "swaps": swaps,
              "steady_s": steady_s, "forkserver": forkserver.enabled(), "runs": []}
    server = start_torchserve(store, BENCH_OUT / "swaps-ts", slot_dir=BENCH_OUT / "swaps-slots")
    os.environ[settings.get("slot_dir").env] = str(server.slot_dir)  # the Swapper reads the workers' status files
    try:
        client = server.management_client()
        swapper = Swapper(client, store, cores=[0, 1], settings=SwapSettings())
        for m in models:
            client.register(m, m, 1)
            for mode in modes:
                print(f"{m} {mode}", file=sys.stderr)
                run = run_mode(server, swapper, m, mode, store, clients, swaps, steady_s)
                run["loadavg_after"] = os.getloadavg()
                result["runs"].append(run)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=1) + "\n")
            client.unregister(m, client.describe(m)["modelVersion"])
    finally:
        server.stop()
    result["loadavg_after"] = os.getloadavg()
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def report(result: dict) -> str:
    """The markdown tables printed after a run (pasted into docs/live-plans.md)."""
    mach = result["machine"]
    lines = [
        f"\n{mach.get('cpu')} ({', '.join(mach.get('flags', []))}), {mach['cpus']} CPUs, {result['when']}, "
        f"load average before {tuple(round(x, 2) for x in result['loadavg_before'])}, "
        f"after {tuple(round(x, 2) for x in result['loadavg_after'])}, workers "
        f"{'forked by the fork server' if result['forkserver'] else 'started cold (PACKRAT_FORKSERVER=0)'}\n",
        "| model | mode | warm live p50 / max s | warm total p50 / max s | cold live s (1st, 2nd) "
        "| steady p99 ms | during-swap p99 ms | ratio | live p50 <= 5 s | live max <= 8 s | p99 <= 1.5x |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        s = run["summary"]
        lines.append(
            f"| {run['model']} | {run['mode']} | {s['warm_live_s']['p50']} / {s['warm_live_s']['max']} "
            f"| {s['warm_total_s']['p50']} / {s['warm_total_s']['max']} "
            f"| {', '.join(str(x) for x in s['cold_live_s'])} | {s['steady']['p99_ms']} "
            f"| {s['during_swaps']['p99_ms']} | {s['p99_ratio']} "
            f"| {verdict(s['warm_live_s']['p50'], TARGET_P50_S)} | {verdict(s['warm_live_s']['max'], TARGET_MAX_S)} "
            f"| {verdict(s['p99_ratio'], TARGET_P99_RATIO)} |")
    lines += ["\np99 ms of the requests during warm swaps, by what each overlapped:\n",
              "| model | mode | steady | during swaps | while the new version loads | after it is live (drain) |",
              "|---|---|---|---|---|---|"]
    for run in result["runs"]:
        s = run["summary"]
        lines.append(f"| {run['model']} | {run['mode']} | {s['steady']['p99_ms']} | {s['during_swaps']['p99_ms']} "
                     f"| {s['during_loading']['p99_ms']} | {s['during_draining']['p99_ms']} |")
    return "\n".join(lines + _phase_lines(result["runs"]) + _cpu_lines(result["runs"]))


def _phase_lines(runs: list[dict]) -> list[str]:
    lines = ["\nWarm swaps, median seconds per phase:\n"]
    names: list[str] = []
    for run in runs:
        names += [k for k in run["summary"]["warm_phase_medians_s"] if k not in names]
    lines += ["| model | mode | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for run in runs:
        ph = run["summary"]["warm_phase_medians_s"]
        lines.append(f"| {run['model']} | {run['mode']} | " + " | ".join(str(ph.get(k, "")) for k in names) + " |")
    return lines


def _cpu_lines(runs: list[dict]) -> list[str]:
    lines = ["\nWho had the cores, warm swaps by direction (medians): cores used by the serving (old) "
             "workers and the new ones in the 2 s before and while the new version loaded; requests "
             "that overlapped the loading against the median of those in the 3 s before:\n",
             "| model | mode | to | swaps | serving before | serving / new / all while loading "
             "| loading mean / max vs before |",
             "|---|---|---|---:|---:|---|---|"]
    for run in runs:
        for to in ("thin", "fat"):
            rows = [r for r in run["summary"]["cpu_split"] if r["to"] == to and "loading_mean_vs_before" in r]
            if not rows:
                continue

            def m(get):
                vals = [v for v in (get(r) for r in rows) if v is not None]
                return med(vals) if vals else "n/a"
            lines.append(
                f"| {run['model']} | {run['mode']} | {to} | {len(rows)} | {m(lambda r: r['before']['serving'])} "
                f"| {m(lambda r: r['loading']['serving'])} / {m(lambda r: r['loading']['new'])} / "
                f"{m(lambda r: r['loading']['all'])} | {m(lambda r: r['loading_mean_vs_before'])} / "
                f"{m(lambda r: r['loading_max_vs_before'])} |")
    return lines

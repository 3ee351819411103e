"""Live swaps of one model measured: duration, phases, and p50/p99 during a swap against
steady state, each plan's steady state apart (scripts/measure_swap.py says how).

The plan alternates thin (2 x 1 thread) <-> fat (1 x 2 threads) under a closed load; every
answer is checked against the one the same text got before the first swap.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from packrat.apply.client import session_for
from packrat.apply.swap import SwapSettings, Swapper
from packrat.bench.loadgen import ContinuousLoad, Sample, in_windows, latency_summary
from packrat.bench.machine import describe_machine
from packrat.bench.paths import BENCH_OUT
from packrat.bench.swap_shapes import thin_and_fat
from packrat.server import start_torchserve

THIN, FAT = thin_and_fat()


def build(model: str, store: Path) -> None:
    from packrat.archive import build_from_dir, build_named
    from packrat.archive.local_tokenizers import minilm_dir

    if model == "minilm":
        build_from_dir(minilm_dir(), store, "minilm", reuse_current=True)
    else:
        build_named(model, store, reuse_current=True)


def same_answer(a: object, b: object) -> bool:
    """Same weights in every version; thread count may move float results in the last bits."""
    if isinstance(a, dict) and "embedding" in a:
        a, b = a["embedding"], b["embedding"]
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(abs(x - y) < 1e-4 for x, y in zip(a, b))
    if isinstance(a, dict) and "scores" in a:
        return a.get("label") == b.get("label")
    return a == b


@dataclass
class _Run:
    t_begin: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    plan_spans: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, plan name)


def _swap_under_load(model: str, swaps: int, clients: int, steady_s: float) -> _Run:
    store = BENCH_OUT / "swap-store"
    store.mkdir(parents=True, exist_ok=True)
    for p in store.glob(f"{model}.p*"):
        shutil.rmtree(p)
    build(model, store)
    texts = [f"sentence {i}: the servers answer requests about weather and coffee".encode() for i in range(16)]
    server = start_torchserve(store, BENCH_OUT / "swap-scratch")
    done = _Run()
    try:
        client = server.management_client()
        client.register(model, model, 1)
        url = f"{server.inference_url}/predictions/{model}"
        with session_for(url) as direct:  # never via a proxy: the key
            refs = [direct.post(url, data=t, headers=server.inference_headers(), timeout=120).content for t in texts]
        swapper = Swapper(client, store, cores=[0, 1], settings=SwapSettings())
        # Get off the plain version first (not measured: it is a different starting shape).
        swapper.apply(model, FAT)
        load = ContinuousLoad(url=url, headers=server.inference_headers(), bodies=texts,
                              check=lambda i, body: same_answer(json.loads(body), json.loads(refs[i])),
                              clients=clients).start()
        done.t_begin = time.monotonic()
        time.sleep(steady_s)
        current, since = "1x2", done.t_begin + 3.0  # skip 3 s of warm-up
        for k in range(swaps):
            target, name = (THIN, "2x1") if k % 2 == 0 else (FAT, "1x2")
            a = time.monotonic()
            rec = swapper.apply(model, target)
            b = time.monotonic()
            done.plan_spans.append((since, a, current))
            done.windows.append((a, b))
            done.records.append(rec.to_dict())
            print(f"swap {k + 1}: -> {name} {rec.duration_s:.1f}s {rec.phases_s}", file=sys.stderr)
            current, since = name, b
            time.sleep(steady_s)
        done.plan_spans.append((since, time.monotonic(), current))
        done.samples = load.stop()
    finally:
        server.stop()
    return done


def measure_swap(model: str, swaps: int, clients: int, steady_s: float, out: Path) -> dict:
    """Run, write the result (raw per-swap records, summaries, samples) to `out`, return it."""
    done = _swap_under_load(model, swaps, clients, steady_s)
    samples, t_begin = done.samples, done.t_begin
    during = in_windows(samples, done.windows)
    during_ids = {id(s) for s in during}
    steady = {}
    for name in ("1x2", "2x1"):
        spans = [(a, b) for a, b, n in done.plan_spans if n == name]
        chosen = [s for s in in_windows(samples, spans) if id(s) not in during_ids]
        steady[name] = latency_summary(chosen, digits=2)
    result = {
        "model": model,
        "clients": clients,
        "swaps": done.records,
        "during_swaps": latency_summary(during, digits=2),
        "steady": steady,
        "all": latency_summary(samples, digits=2),
        # Raw samples: start (s since the load began), latency (ms), ok; for plots and re-analysis.
        "samples": [[round(x.start - t_begin, 3), round(x.latency_s * 1000, 2), x.ok] for x in samples],
        "swap_windows": [[round(a - t_begin, 3), round(b - t_begin, 3)] for a, b in done.windows],
        "machine": describe_machine().as_dict(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def report(result: dict) -> str:
    """The markdown tables printed after a run (pasted into docs/live-plans.md)."""
    lines = [f"\nModel `{result['model']}`, {result['clients']} closed-loop clients, {result['machine']['cpu']}, "
             f"{result['when']}\n",
             "| swap | to | duration s | workers start (register + READY and pinned) s | drain s | retire s |",
             "|---|---|---|---|---|---|"]
    for i, r in enumerate(result["swaps"], 1):
        p = r["phases_s"]
        shape = " + ".join(f"{x['threads']}t" for x in r["plan"]["instances"])
        start = p.get("register", 0) + p.get("ready", 0)
        lines.append(f"| {i} | {shape} | {r['duration_s']:.1f} | {start:.1f} | {p.get('drain', 0):.2f} "
                     f"| {p.get('retire', p.get('unregister', 0)):.2f} |")
    lines += ["\n| window | requests | failed | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|---|"]
    steady = result["steady"]
    for label, s in [("steady 1x(2 threads)", steady["1x2"]), ("steady 2x(1 thread)", steady["2x1"]),
                     ("during swaps", result["during_swaps"])]:
        lines.append(f"| {label} | {s['requests']} | {s['failed']} | {s['p50_ms']} | {s['p99_ms']} | {s['max_ms']} |")
    return "\n".join(lines)

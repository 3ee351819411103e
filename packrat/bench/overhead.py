"""TorchServe's own cost beside the model's: issue 15's per-request targets, in one run
(scripts/bench_overhead.py says what is measured and why each point is taken as it is).

measure() appends every row to a JSONL file as it lands; render() reads only that file
and holds the run against the targets.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from packrat.bench.machine import describe_machine
from packrat.bench.mode_runs import (
    Results, bench_torchserve, build_archive, last_run, load_mode, request_body, time_calls,
)


def in_process(*args, **kwargs) -> bytes:
    """measure_in_process() in a process of its own that exits after it: a runtime loaded in
    the process that then sends the TorchServe requests slows them (on the 2-core EPYC an
    OpenVINO model loaded beside the client took DistilBERT's p50 through TorchServe from
    7.6 to 9.7 ms, and 9.1 ms after it was deleted: its thread pool stays)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure_in_process, args, kwargs)


def measure_in_process(model: str, mode: str, batch: int, seconds: float, results: Results, run: str,
                       store: Path, when: str, max_length: int | None = None, threads: int | None = None) -> bytes:
    """threads: None for all cores; 1 pins the process to its last core, as a thin worker is."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if threads == 1:
        os.sched_setaffinity(0, {cores[-1]})
    torch.set_num_threads(threads or len(cores))
    archive = build_archive(model, store, f"{model}-inproc", max_length=max_length)
    task = load_mode(archive, mode)
    requests = task.sample_requests(batch)
    prepared = task.preprocess(requests)
    for path, fn in (("forward", lambda: task.forward(prepared)), ("handler", lambda: task.run(requests))):
        results.add(run=run, kind="in-process", model=model, mode=mode, batch=batch, path=path, when=when,
                    threads=task.runner.threads, **time_calls(fn, seconds, min_reps=20, max_reps=10**9))
    if batch == 1:
        results.add(run=run, kind="in-process", model=model, mode=mode, batch=batch, path=GAPPED, when=when,
                    threads=task.runner.threads,
                    **time_calls(lambda: task.forward(prepared), seconds, min_reps=20, max_reps=10**9,
                                 gap_s=GAP_S))
    return requests[0]["body"]


# A served worker idles between requests for about TorchServe's round trip (the no-op's
# p50: 0.9-5.4 ms in docs/live-plans.md's runs, the low end after the frontend's warm-up);
# a tight in-process loop never does, so its runtime threads stay awake and its caches
# warm. This path times the forward after such a gap.
GAP_S = 0.005
GAPPED = "forward after a 5 ms idle gap"


def measure(mode: str, seconds: float, requests: int, warm_s: float, text: str, image: str, out: Path,
            command: str) -> None:
    """The no-op, the text model at batch 1 and the image model at B = 8, in process before
    and after each TorchServe point."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks stop TorchServe
    results = Results(out)
    run = time.strftime("%Y%m%dT%H%M%S")
    results.add(run=run, kind="machine", cpu=describe_machine().label, cores=len(os.sched_getaffinity(0)),
                torch=importlib.metadata.version("torch"), load_avg=os.getloadavg(), command=command)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        tmp = Path(tmp)
        bench_torchserve("noop", "fp32-eager", [1], results, run, tmp / "ts-noop", requests,
                         b'{"x": 1}', "application/json", shapes=("fat", "thin"), label="torchserve",
                         warm_s=warm_s, thin_below_cores=True)
        for threads in (None, 1):
            body = in_process(text, mode, 1, seconds, results, run, tmp / "store", "before",
                              max_length=8, threads=threads)
        bench_torchserve(text, mode, [1], results, run, tmp / "ts-text", requests,
                         body, "text/plain", shapes=("fat", "thin"), max_length=8, label="torchserve",
                         warm_s=warm_s, thin_below_cores=True)
        for threads in (None, 1):
            in_process(text, mode, 1, seconds, results, run, tmp / "store", "after",
                       max_length=8, threads=threads)
        in_process(image, mode, 8, seconds, results, run, tmp / "store", "before")
        body, ctype = request_body(image)
        bench_torchserve(image, mode, [8], results, run, tmp / "ts-image", requests // 2,
                         body, ctype, label="torchserve", warm_s=warm_s)
        in_process(image, mode, 8, seconds, results, run, tmp / "store", "after")


def render(path: Path) -> str:
    run, lines = last_run(path)
    lines += ["| model | B | where | p50 ms | min ms | n | load avg |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in run:
        if r["kind"] == "in-process":
            where = f"in process, {r['path']} ({r['when']}), {r['threads']} thread{'s' if r['threads'] != 1 else ''}"
            lines.append(f"| {r['model']} | {r['batch']} | {where} | {r['p50_ms']} | {r['min_ms']} | "
                         f"{r['reps']} | {r['load_avg_1m']} |")
        elif r["kind"] == "torchserve":
            warmed = f", after {r['warm_s']:g} s of load" if r.get("warm_s") else ""
            lines.append(f"| {r['model']} | {r['batch']} | TorchServe {r['shape']} ({r['mode']}{warmed}) | "
                         f"{r.get('p50_ms')} | {r.get('min_ms')} | {r.get('ok', r.get('requests'))} | "
                         f"{r['load_avg_1m']} |")
    lines += ["", *targets(run)]
    return "\n".join(lines)


def targets(run: list[dict]) -> list[str]:
    """Issue 15's two per-request targets read from one run (in process: the faster of before/after).
    Batch 1 is held against the in-process forward with the shape's threads (fat: all cores,
    thin: 1); B = 8 against the forward with all cores, fat and thin alike."""
    cores = next((r["cores"] for r in run if r["kind"] == "machine"), None)

    def inproc(model: str, path: str, threads: int | None) -> float | None:
        times = [r["p50_ms"] for r in run if r["kind"] == "in-process" and r["model"] == model
                 and r["path"] == path and (threads is None or r["threads"] == threads)]
        return min(times) if times else None

    served = {(r["model"], r["batch"], r["shape"]): r["p50_ms"] for r in run
              if r["kind"] == "torchserve" and r.get("p50_ms")}
    noop_fat = served.get(("noop", 1, "fat"))
    out = []
    for (model, batch, shape), ms in served.items():
        if model == "noop":
            continue
        if batch == 1:
            threads = 1 if shape == "thin" else cores
            forward, handler = inproc(model, "forward", threads), inproc(model, "handler", threads)
            # Like for like: the no-op in the same shape (a worker pinned to one core might pay
            # more to be woken; on the 2-core EPYC it did not: 0.96 thin vs 1.08 ms fat).
            noop_shape = shape if ("noop", 1, shape) in served else "fat"
            noop = served.get(("noop", 1, noop_shape))
            if forward is None or noop is None:
                continue
            out.append(f"- {model}, batch 1, {shape} ({threads} thread{'s' if threads != 1 else ''}): through "
                       f"TorchServe {ms:.2f} ms against in-process forward {forward:.2f} + no-op {noop_shape} {noop:.2f} + "
                       f"1 ms = {budget_verdict(ms, forward, noop)}; "
                       f"the handler's whole path in process takes {handler:.2f} ms"
                       + gapped_note(run, model, forward, threads) + fat_noop_note(ms, forward, noop_shape, noop_fat)
                       + ".")
        else:
            forward, handler = inproc(model, "forward", None), inproc(model, "handler", None)
            out.append(f"- {model}, B = {batch}, {shape}: through TorchServe {ms:.1f} ms = {ms / forward:.2f}x the "
                       f"in-process forward ({forward:.1f} ms), {ms / handler:.2f}x the in-process handler path "
                       f"({handler:.1f} ms; target <= 1.25x: {'met' if ms <= 1.25 * forward else 'not met'}).")
    return out


def budget_verdict(ms: float, forward: float, noop: float) -> str:
    """Issue 15's batch-1 budget, forward + no-op + 1 ms, and whether `ms` is within it."""
    budget = forward + noop + 1.0
    return f"{budget:.2f} ms: " + ("met" if ms <= budget else f"not met (+{ms - budget:.2f} ms)")


def fat_noop_note(ms: float, forward: float, shape: str, noop_fat: float | None) -> str:
    if shape == "fat" or noop_fat is None:
        return ""
    return f"; against the fat no-op ({noop_fat:.2f}) the budget is {budget_verdict(ms, forward, noop_fat)}"


def gapped_note(run: list[dict], model: str, forward: float, threads: int | None) -> str:
    gapped = [r["p50_ms"] for r in run if r["kind"] == "in-process" and r["model"] == model
              and r["path"] == GAPPED and r["threads"] == threads]
    if not gapped:
        return ""
    return (f", and the forward after a {GAP_S * 1000:g} ms idle gap {min(gapped):.2f} ms "
            f"(+{min(gapped) - forward:.2f} ms over the tight loop)")

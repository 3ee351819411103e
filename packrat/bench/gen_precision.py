"""GPT-2 greedy generation in process, by precision: fp32, bf16 autocast, bf16 weights (bf16w).

    python -m packrat.bench.gen_precision --store /tmp/gen-store --out docs/benchmarks/X.jsonl \
        [--arch tiny-gpt2 --arch gpt2] [--rounds 3] [--batch 8] [--new-tokens 20] [--min-s 1] [--threads N]
    python -m packrat.bench.gen_precision --render docs/benchmarks/X.jsonl [--run 2026-12-04T19:42:48Z]

Each architecture's archive is built once (seeded weights) and each mode loaded through the
handler as TorchServe's worker loads it, accuracy guard at its defaults (a refused mode is
recorded, not timed). Then the modes are timed interleaved, round by round (fp32, bf16,
bf16w, fp32, ...), so a change of load on a shared machine reaches all of them. One call is
one batch of `batch` copies of the task's sample prompt, `new_tokens` greedy tokens each,
repeated for at least `min_s` seconds per mode and round. Wall time from perf_counter; this
process's CPU time from /proc/self/stat (utime + stime); each row carries the 1-minute load
average (packrat.bench.mode_runs.Results). render() reads only the JSONL file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from packrat.bench.machine import describe_machine
from packrat.bench.mode_runs import Results, build_archive, load_mode, log

MODES = ("fp32-eager", "bf16-eager", "bf16w-eager")


def cpu_s() -> float:
    """This process's user + system CPU seconds, from /proc/self/stat."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _call(task, batch: int, new_tokens: int):
    """One generation call as the handler runs it; returns (one call, tokens it generates)."""
    from packrat_tasks.generation import SAMPLE_PROMPT

    body = json.dumps({"text": SAMPLE_PROMPT, "max_new_tokens": new_tokens}).encode()
    prepared = task.preprocess([{"body": body}] * batch)

    def call() -> int:
        return int(task.forward(prepared).outputs.numel())

    return call


def time_round(call, min_s: float) -> dict:
    calls, tokens = 0, 0
    c0, t0 = cpu_s(), time.perf_counter()
    while calls == 0 or time.perf_counter() - t0 < min_s:
        tokens += call()
        calls += 1
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    return {"calls": calls, "wall_ms": round(wall * 1000 / calls, 1), "cpu_ms": round(cpu * 1000 / calls, 1),
            "tokens_per_s": round(tokens / wall, 1)}


def bench_arch(arch: str, store: Path, args: argparse.Namespace, results: Results, run: str) -> None:
    import torch

    archive = build_archive(arch, store, arch, max_new_tokens_cap=args.new_tokens)
    calls = {}
    for mode in MODES:
        try:
            task = load_mode(archive, mode)
        except Exception as exc:  # noqa: BLE001 - a refused or unsupported mode is a result
            results.add(run=run, kind="mode", arch=arch, mode=mode, error=f"{type(exc).__name__}: {exc}")
            continue
        summary = task.runner.summary()
        results.add(run=run, kind="mode", arch=arch, mode=mode, threads=torch.get_num_threads(),
                    guard=(summary["guard"] or {}).get("message"), rss_mb=summary["rss_mb"],
                    rss_delta_mb=summary["rss_delta_mb"], bf16w=summary.get("bf16w"))
        calls[mode] = _call(task, args.batch, args.new_tokens)
        calls[mode]()  # warm: the first call at this batch shape allocates
    for r in range(args.rounds):
        for mode, call in calls.items():
            results.add(run=run, kind="call", arch=arch, mode=mode, round=r, batch=args.batch,
                        new_tokens=args.new_tokens, **time_round(call, args.min_s))


def speedup(calls: list[dict], mode: str, key: str) -> float:
    """Median over rounds of fp32's `key` / `mode`'s in the same round: interleaving puts
    both under the same load, so the ratio holds where the times themselves move."""
    by_round = {r["round"]: r[key] for r in calls if r["mode"] == "fp32-eager"}
    return statistics.median(by_round[r["round"]] / r[key] for r in calls
                             if r["mode"] == mode and r["round"] in by_round)


def render(path: Path, run: str | None = None) -> str:
    """The table of one run in a results file (default: its last)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = run or rows[-1]["run"]
    rows = [r for r in rows if r["run"] == run]
    machine = next(r for r in rows if r["kind"] == "machine")
    threads = sorted({r["threads"] for r in rows if "threads" in r})
    out = [f"Run {run}: {machine['cpu']} ({', '.join(machine['flags'])}), {machine['cores']} cores, "
           f"torch threads {', '.join(map(str, threads)) or '?'}, torch {machine['torch']}, "
           f"transformers {machine['transformers']}", f"Command: {machine.get('command', '?')}", "",
           "| model | mode | guard | wall ms per call, each round | CPU ms per call, each round "
           "| tokens/s (median) | fp32 / mode, wall | fp32 / mode, CPU | load avg (1 min) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for arch in dict.fromkeys(r["arch"] for r in rows if "arch" in r):
        calls = [r for r in rows if r.get("arch") == arch and r["kind"] == "call"]
        for m in (r for r in rows if r.get("arch") == arch and r["kind"] == "mode"):
            mine = [r for r in calls if r["mode"] == m["mode"]]
            if not mine:
                out.append(f"| {arch} | {m['mode']} | {m.get('error') or m.get('guard')} | | | | | | |")
                continue
            guard = "passed" if "passed" in (m.get("guard") or "") else (m.get("guard") or "reference")
            out.append(f"| {arch} | {m['mode']} | {guard} | {', '.join(str(r['wall_ms']) for r in mine)} "
                       f"| {', '.join(str(r['cpu_ms']) for r in mine)} "
                       f"| {statistics.median(r['tokens_per_s'] for r in mine)} "
                       f"| {speedup(calls, m['mode'], 'wall_ms'):.2f}x | {speedup(calls, m['mode'], 'cpu_ms'):.2f}x "
                       f"| {', '.join(str(r['load_avg_1m']) for r in mine)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=Path("/tmp/packrat-gen-precision"))
    parser.add_argument("--out", type=Path, default=Path("gen-precision.jsonl"))
    parser.add_argument("--arch", action="append", default=None, help="tiny-gpt2, gpt2 (default both)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--min-s", type=float, default=1.0, help="seconds of calls per mode and round")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads, as a worker's slot sets them (default: torch's)")
    parser.add_argument("--render", type=Path, default=None, help="print a results file's last run")
    parser.add_argument("--run", default=None, help="with --render: this run (its start time) instead")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.render:
        print(render(args.render, args.run))
        return
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    results = Results(args.out)
    run = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results.add(run=run, kind="machine", **describe_machine().as_dict(), torch=torch.__version__,
                transformers=transformers.__version__,
                command=" ".join(["python -m packrat.bench.gen_precision", *argv]))
    args.store.mkdir(parents=True, exist_ok=True)
    for arch in args.arch or ["tiny-gpt2", "gpt2"]:
        log(f"{arch}: building and loading {', '.join(MODES)}")
        bench_arch(arch, args.store, args, results, run)
    print(render(args.out))


if __name__ == "__main__":
    main()

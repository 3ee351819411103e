#!/usr/bin/env python
"""Two commits' serving cost side by side: the served level of scripts/bench_efficiency.py
(one model, mode, plan and payload through a private TorchServe, C closed-loop clients),
in sessions that alternate between two git commits in the order A B B A (a drift of the
machine over the run then weighs on both alike), and per window the throughput, p50 and
the CPU time per request of the workers and of the frontend JVM (from /proc).

Each session runs this file again with PYTHONPATH at a worktree of its commit, so the
controller, the fork server and the workers all run that commit's code; the archive is
built once (by the first session) and shared. The first --skip windows of a session are
left out of the summary (TorchServe's JVM is still compiling its path then).

    python scripts/bench_code_ab.py --a 3adce48 --b HEAD --model bert-base \\
        --mode int8-onnxruntime --plan '2x(t1,b4)' --max-length 8 --name read-ahead-bert8

Writes docs/benchmarks/code-ab-<name>.jsonl (a line per window) and .md (the machine named).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def session(args: argparse.Namespace) -> None:
    """One served session with the packrat on PYTHONPATH; a JSON line per window on stdout."""
    from dataclasses import replace

    import packrat
    from packrat.bench.efficiency import EfficiencySettings, Served, parse_plan, prepare
    from packrat.bench.run import sample_request
    from packrat.cores import usable_cores
    from packrat.modes import ExecutionMode
    from packrat.plan import plan_from_shape

    s = EfficiencySettings(model=args.model, out=Path(args.work), mode=args.mode, plan=args.plan,
                           max_length=args.max_length, served_s=args.window_s, rewarm_s=3.0)
    plan = replace(plan_from_shape(parse_plan(s.plan), len(usable_cores().cores), None),
                   mode=str(ExecutionMode.parse(s.mode)))
    archive = prepare(s, Path(args.work) / "model-store")
    body, ctype = sample_request(archive)
    served = Served(s, archive, plan, body, ctype)
    try:
        served.load(args.warm_s)
        for window in range(args.windows):
            r = served.measure()
            cpu = r["cpu"]
            workers = sum(v["cpu_ms"] or 0.0 for k, v in cpu.items() if k.startswith("worker"))
            jvm = sum(v["cpu_ms"] or 0.0 for k, v in cpu.items() if k.startswith("frontend JVM"))
            print(json.dumps({"window": window, "items_per_s": r["items_per_s"], "p50_ms": r["p50_ms"],
                              "requests": r["requests"], "worker_ms_per_request": round(workers / r["requests"], 4),
                              "jvm_ms_per_request": round(jvm / r["requests"], 4),
                              "packrat": str(Path(packrat.__file__).parent)}), flush=True)
    finally:
        served.stop()


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 4)


def render(rows: list[dict], meta: dict) -> str:
    """The results file: front matter, what ran, a line per window, the medians and the ratio."""
    kept = [r for r in rows if r["window"] >= meta["skip"]]
    by = {side: [r for r in kept if r["side"] == side] for side in ("A", "B")}
    med = {side: {k: _median(rs, k) for k in ("items_per_s", "p50_ms", "worker_ms_per_request",
                                              "jvm_ms_per_request")} for side, rs in by.items() if rs}
    ratio = round(med["B"]["items_per_s"] / med["A"]["items_per_s"], 3) if len(med) == 2 else None
    spread = {side: (min(r["items_per_s"] for r in rs), max(r["items_per_s"] for r in rs)) for side, rs in by.items() if rs}
    figures = (f"B/A served throughput {ratio} (A {spread['A'][0]:.0f}-{spread['A'][1]:.0f}, "
               f"B {spread['B'][0]:.0f}-{spread['B'][1]:.0f} req/s); worker CPU a request A "
               f"{med['A']['worker_ms_per_request']} ms, B {med['B']['worker_ms_per_request']} ms") if ratio else "no windows"
    lines = ["---", f"date: {meta['date']}", f"machine: {meta['machine']}", f"command: {meta['command']}",
             f"figures: {figures}", "---", "",
             f"# Served cost of two commits: A {meta['a']} against B {meta['b']}", "",
             f"{meta['model']} {meta['mode']} {meta['plan']}"
             + (f", {meta['max_length']}-token payload" if meta.get("max_length") else "")
             + f", the plan's clients, closed loop. Sessions in the order {' '.join(meta['order'])}, "
             f"{meta['warm_s']:.0f} s of load first, then {meta['windows']} windows of {meta['window_s']:.0f} s; "
             f"the first {meta['skip']} of each left out of the medians (the JVM's JIT).", "",
             "| session | side | commit | window | req/s | p50 ms | worker CPU ms / req | JVM CPU ms / req |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['session']} | {r['side']} | {r['commit']} | {r['window']}{' (left out)' if r['window'] < meta['skip'] else ''} | "
              f"{r['items_per_s']:.1f} | {r['p50_ms']:.2f} | {r['worker_ms_per_request']:.3f} | {r['jvm_ms_per_request']:.3f} |"
              for r in rows]
    lines += ["", "| side | commit | windows | req/s (median) | p50 ms | worker CPU ms / req | JVM CPU ms / req |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {side} | {meta[side.lower()]} | {len(by[side])} | {m['items_per_s']} | {m['p50_ms']} | "
              f"{m['worker_ms_per_request']} | {m['jvm_ms_per_request']} |" for side, m in med.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="HEAD~1", help="commit A (the one before)")
    ap.add_argument("--b", default="HEAD", help="commit B")
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--mode", default="int8-onnxruntime")
    ap.add_argument("--plan", default="2x(t1,b4)")
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--warm-s", type=float, default=45.0)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--skip", type=int, default=1, help="windows at a session's start left out of the medians")
    ap.add_argument("--name", help="file stem: code-ab-<name>")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--session", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.session:
        session(args)
        return 0
    if not args.name:
        ap.error("--name is required")
    out = args.out_dir / f"code-ab-{args.name}.jsonl"
    if out.exists():
        ap.error(f"{out} exists: choose another --name")
    from packrat.bench.machine import describe_machine

    commits = {side: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True,
                                    capture_output=True, text=True).stdout.strip()
               for side, ref in (("A", args.a), ("B", args.b))}
    order = ["A", "B", "B", "A"]
    started = time.time()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="packrat-code-ab-") as tmp:
        trees = {}
        for side, commit in commits.items():
            trees[side] = Path(tmp) / side
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(trees[side]), commit],
                           check=True)
        try:
            for n, side in enumerate(order, 1):
                tree = trees[side]
                env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'handlers'}"}
                cmd = [sys.executable, str(Path(__file__).resolve()), "--session", "--work", str(Path(tmp) / "work"),
                       "--model", args.model, "--mode", args.mode, "--plan", args.plan, "--warm-s", str(args.warm_s),
                       "--windows", str(args.windows), "--window-s", str(args.window_s)]
                if args.max_length:
                    cmd += ["--max-length", str(args.max_length)]
                done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.stderr.write(done.stderr[-4000:])
                    raise SystemExit(f"session {n} ({side}, {commits[side]}) failed: exit {done.returncode}")
                for line in done.stdout.splitlines():
                    if line.startswith("{"):
                        row = {"session": n, "side": side, "commit": commits[side], **json.loads(line)}
                        if not row.pop("packrat").startswith(str(tree)):
                            raise SystemExit(f"session {n} imported packrat from outside {tree}")
                        rows.append(row)
                        print(row, flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    machine = describe_machine()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)) + time.strftime("-%H:%M UTC", time.gmtime()),
            "machine": f"{machine.cpu}, {machine.cores} cores",
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "a": commits["A"], "b": commits["B"],
            "model": args.model, "mode": args.mode, "plan": args.plan, "max_length": args.max_length,
            "warm_s": args.warm_s, "windows": args.windows, "window_s": args.window_s, "skip": args.skip,
            "order": order}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"kind": "window", **r}) + "\n" for r in rows)
                   + json.dumps({"kind": "run", **meta}) + "\n")
    out.with_suffix(".md").write_text(render(rows, meta))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

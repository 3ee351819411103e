"""Two commits' serving cost side by side (scripts/bench_code_ab.py): the served level of
packrat.bench.efficiency (one model, mode, plan and payload through a private TorchServe,
the plan's closed-loop clients) in sessions that alternate between two git commits in the
order A B B A (a drift of the machine over the run then weighs on both alike), and per
window the throughput, p50 and the CPU time per request of the workers and of the frontend
JVM (from /proc).

Each session runs this file by its path with PYTHONPATH at a git worktree of its commit,
so the controller, the fork server and the workers all run that commit's code (this file
imports nothing of its own tree in a session, only what both commits have:
packrat.bench.efficiency's Served). The archive is built once, by the first session. The
first `skip` windows of a session are left out of the medians (TorchServe's JVM is still
compiling its path then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ORDER = ("A", "B", "B", "A")


@dataclass(frozen=True)
class CodeAB:
    a: str  # commit A (the one before)
    b: str  # commit B
    name: str  # file stem: code-ab-<name>
    model: str = "bert-base"
    mode: str = "int8-onnxruntime"
    plan: str = "2x(t1,b4)"
    max_length: int | None = None
    warm_s: float = 45.0
    windows: int = 3
    window_s: float = 15.0
    skip: int = 1
    out_dir: Path = Path("docs/benchmarks")
    repo: Path = Path(".")
    command: str = ""


def session(argv: list[str]) -> None:
    """One served session with the packrat on PYTHONPATH; a JSON line per window on stdout."""
    ap = argparse.ArgumentParser()
    for flag in ("--work", "--model", "--mode", "--plan"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--max-length", type=int, default=None)
    for flag in ("--warm-s", "--window-s"):
        ap.add_argument(flag, type=float, required=True)
    ap.add_argument("--windows", type=int, required=True)
    args = ap.parse_args(argv)
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
    served = Served(s, archive, plan, *sample_request(archive))
    try:
        served.load(args.warm_s)
        for window in range(args.windows):
            r = served.measure()
            workers = sum(v["cpu_ms"] or 0.0 for k, v in r["cpu"].items() if k.startswith("worker"))
            jvm = sum(v["cpu_ms"] or 0.0 for k, v in r["cpu"].items() if k.startswith("frontend JVM"))
            print(json.dumps({"window": window, "items_per_s": r["items_per_s"], "p50_ms": r["p50_ms"],
                              "requests": r["requests"], "worker_ms_per_request": round(workers / r["requests"], 4),
                              "jvm_ms_per_request": round(jvm / r["requests"], 4),
                              "packrat": str(Path(packrat.__file__).parent)}), flush=True)
    finally:
        served.stop()


def _session_command(opts: CodeAB, work: Path) -> list[str]:
    # -P: this file's folder stays off sys.path (its modules would shadow the worktree's as top-level names)
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--work", str(work), "--model", opts.model,
           "--mode", opts.mode, "--plan", opts.plan, "--warm-s", str(opts.warm_s),
           "--windows", str(opts.windows), "--window-s", str(opts.window_s)]
    return cmd + (["--max-length", str(opts.max_length)] if opts.max_length else [])


def _git(opts: CodeAB, *args: str) -> str:
    return subprocess.run(["git", "-C", str(opts.repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def run(opts: CodeAB) -> Path:
    """The sessions in ORDER, then the results files; returns the .md's path."""
    from packrat.bench.machine import describe_machine

    out = opts.out_dir / f"code-ab-{opts.name}.jsonl"
    if out.exists():
        raise FileExistsError(f"{out} exists: choose another name")
    commits = {"A": _git(opts, "rev-parse", "--short", opts.a), "B": _git(opts, "rev-parse", "--short", opts.b)}
    started, rows = time.time(), []
    with tempfile.TemporaryDirectory(prefix="packrat-code-ab-") as tmp:
        trees = {side: Path(tmp) / side for side in commits}
        for side, tree in trees.items():
            _git(opts, "worktree", "add", "--detach", "-q", str(tree), commits[side])
        try:
            for n, side in enumerate(ORDER, 1):
                rows += _session(opts, n, side, commits[side], trees[side], Path(tmp) / "work")
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(opts.repo), "worktree", "remove", "--force", str(tree)], check=False)
    machine = describe_machine()
    meta = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
            "a": commits["A"], "b": commits["B"], "order": list(ORDER),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)) + time.strftime("-%H:%M UTC", time.gmtime()),
            "machine": f"{machine.label}, {machine.cores} cores"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"kind": "window", **r}) + "\n" for r in rows)
                   + json.dumps({"kind": "run", **meta}) + "\n")
    out.with_suffix(".md").write_text(render(rows, meta))
    return out.with_suffix(".md")


def _session(opts: CodeAB, n: int, side: str, commit: str, tree: Path, work: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'handlers'}"}
    done = subprocess.run(_session_command(opts, work), env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"session {n} ({side}, {commit}) failed: exit {done.returncode}")
    rows = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = {"session": n, "side": side, "commit": commit, **json.loads(line)}
            if not row.pop("packrat").startswith(str(tree)):
                raise RuntimeError(f"session {n} imported packrat from outside {tree}")
            rows.append(row)
            print(row, flush=True)
    return rows


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


if __name__ == "__main__":  # a session, run by path from run() with PYTHONPATH at a worktree
    session(sys.argv[1:])

"""What one `packrat status` call costs, for two commits side by side (scripts/bench_cli_cost.py):
CPU (user + system, from the kernel's accounting of the finished child) and wall time per
call, against a stand-in controller on loopback that answers five models, in rounds A B B A
(a drift of the machine over the run then weighs on both alike).

Each commit runs from a git worktree of its own, with its bytecode cached as an installed
package's would be (one call first, not counted).
"""

from __future__ import annotations

import http.server
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from packrat.bench.machine import describe_machine

MODELS = ("bert-base", "gpt2", "minilm", "resnet50", "noop")
ORDER = ("A", "B", "B", "A")


@dataclass(frozen=True)
class CliCost:
    a: str  # commit A (the one before)
    b: str  # commit B
    name: str  # file stem: cli-cost-<name>
    rounds: int = 10
    out_dir: Path = Path("docs/benchmarks")
    repo: Path = Path(".")
    command: str = ""


class _StandIn(http.server.BaseHTTPRequestHandler):
    """The controller's answers to `packrat status`, as a settled controller gives them."""

    status = {"version": "p2", "mode": "int8s-openvino", "pin": None, "traffic": None,
              "plan": {"mode": "int8s-openvino", "instances": [{"threads": 1, "batch": 4}] * 2},
              "tune": {"text": "applied int8s-openvino 2x(t1,b4)"}}

    def do_GET(self) -> None:
        parts = self.path.split("/")  # /v1/models or /v1/models/<m>/status
        body = [{"model": m} for m in MODELS] if len(parts) == 3 else {**self.status, "model": parts[3]}
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


def one_call(tree: Path, api: str, key_file: Path, env: dict[str, str]) -> tuple[float, float]:
    """(CPU s, wall s) of one `packrat status` run from the worktree `tree`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "packrat.cli", "status", "--api", api, "--key-file", str(key_file)],
                       cwd=tree, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0 or r.stdout.count("\n") != len(MODELS):
        raise RuntimeError(f"{tree}: packrat status failed ({r.returncode}): {r.stderr or r.stdout}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def measure(opts: CliCost) -> dict:
    """{"commits", "started", "cpu": {side: [s]}, "wall": {side: [s]}}: opts.rounds rounds of A B B A."""
    commits = {side: subprocess.run(["git", "rev-parse", "--short", rev], cwd=opts.repo, capture_output=True,
                                    text=True, check=True).stdout.strip()
               for side, rev in (("A", opts.a), ("B", opts.b))}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api = f"http://127.0.0.1:{server.server_address[1]}"
    out: dict = {"commits": commits, "cpu": {"A": [], "B": []}, "wall": {"A": [], "B": []}}
    with tempfile.TemporaryDirectory(prefix="packrat-cli-cost-") as tmp:
        key_file = Path(tmp) / "key_file.json"
        key_file.write_text(json.dumps({k: {"key": f"k-{k}"} for k in ("inference", "management", "API")}))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")  # bytecode cached, as when installed
        trees = {side: Path(tmp) / side for side in commits}
        try:
            for side, commit in commits.items():
                subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[side]), commit], cwd=opts.repo,
                               check=True)
                one_call(trees[side], api, key_file, env)  # writes its bytecode; not counted
            out["started"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            for _ in range(opts.rounds):
                for side in ORDER:
                    cpu, wall = one_call(trees[side], api, key_file, env)
                    out["cpu"][side].append(cpu)
                    out["wall"][side].append(wall)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=opts.repo, capture_output=True)
            server.shutdown()
            server.server_close()
    return out


def report(opts: CliCost, m: dict) -> str:
    """The results file: front matter (docs/benchmarks' summaries read it) and the table."""
    commits, cpu, wall = m["commits"], m["cpu"], m["wall"]
    med = {side: statistics.median(cpu[side]) for side in cpu}

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.0f} ms ({min(values) * 1000:.0f}-{max(values) * 1000:.0f})"

    return "\n".join([
        "---",
        f"date: {m['started']}",
        f"machine: {describe_machine().label}, {len(os.sched_getaffinity(0))} cores",
        f"command: {opts.command}",
        f"figures: B/A CPU a packrat status call {med['B'] / med['A']:.2f} "
        f"(A {med['A'] * 1000:.0f} ms, B {med['B'] * 1000:.0f} ms, medians)",
        "---",
        "",
        f"# `packrat status` cost: {opts.name}",
        "",
        f"A = {commits['A']}, B = {commits['B']}; {opts.rounds} rounds of A B B A, {2 * opts.rounds} calls each, "
        f"against a stand-in controller answering {len(MODELS)} models (six requests a call).",
        "",
        "| commit | CPU a call, median (min-max) | wall a call, median (min-max) |",
        "|---|---|---|",
        *(f"| {side} {commits[side]} | {ms(cpu[side])} | {ms(wall[side])} |" for side in ("A", "B")),
        "",
        f"B/A CPU a call: **{med['B'] / med['A']:.2f}**",
        "",
    ])


def run(opts: CliCost) -> Path:
    """Measure and write <out_dir>/cli-cost-<name>.md; returns its path."""
    out = Path(opts.out_dir) / f"cli-cost-{opts.name}.md"
    out.write_text(report(opts, measure(opts)))
    return out

#!/usr/bin/env python
"""What one `packrat status` call costs, for two commits side by side: CPU (user + system,
from the kernel's accounting of the finished child) and wall time per call, against a
stand-in controller on loopback that answers five models, in rounds A B B A.

    python scripts/bench_cli_cost.py --a 32772dd --b HEAD --name status-urllib

Each commit runs from a git worktree of its own, with its bytecode cached as an installed
package's would be (one call first, not counted). Writes docs/benchmarks/cli-cost-<name>.md.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

from packrat.bench.machine import describe_machine

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["bert-base", "gpt2", "minilm", "resnet50", "noop"]


def stand_in() -> http.server.ThreadingHTTPServer:
    """A controller stand-in: /v1/models and each model's status, as a settled controller answers."""
    status = {"version": "p2", "mode": "int8s-openvino", "pin": None, "traffic": None,
              "plan": {"mode": "int8s-openvino", "instances": [{"threads": 1, "batch": 4}] * 2},
              "tune": {"text": "applied int8s-openvino 2x(t1,b4)"}}

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.split("/")[3] if self.path.count("/") >= 4 else ""
            body = [{"model": m} for m in MODELS] if self.path == "/v1/models" else {**status, "model": name}
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def one_call(tree: Path, api: str, key_file: Path, env: dict[str, str]) -> tuple[float, float]:
    """(CPU s, wall s) of one `packrat status` run from `tree`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "packrat.cli", "status", "--api", api, "--key-file", str(key_file)],
                       cwd=tree, env={**env, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0 or r.stdout.count("\n") != len(MODELS):
        raise SystemExit(f"{tree}: status failed ({r.returncode}): {r.stderr or r.stdout}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="commit A (the one before)")
    ap.add_argument("--b", default="HEAD", help="commit B")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of A B B A")
    ap.add_argument("--name", required=True, help="file stem: cli-cost-<name>")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    commits = {side: subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout.strip() for side, rev in (("A", args.a), ("B", args.b))}
    server = stand_in()
    api = f"http://127.0.0.1:{server.server_address[1]}"
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    wall: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="packrat-cli-cost-") as tmp:
        key_file = Path(tmp) / "key_file.json"
        key_file.write_text(json.dumps({k: {"key": f"k-{k}"} for k in ("inference", "management", "API")}))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")  # bytecode cached, as when installed
        trees = {side: Path(tmp) / side for side in commits}
        try:
            for side, commit in commits.items():
                subprocess.run(["git", "worktree", "add", "--detach", "-q", str(trees[side]), commit], cwd=ROOT,
                               check=True)
                one_call(trees[side], api, key_file, env)  # writes its bytecode; not counted
            started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            for _ in range(args.rounds):
                for side in ("A", "B", "B", "A"):
                    c, w = one_call(trees[side], api, key_file, env)
                    cpu[side].append(c)
                    wall[side].append(w)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
            server.shutdown()
    med = {side: statistics.median(cpu[side]) for side in cpu}
    command = (f"python scripts/bench_cli_cost.py --a {args.a} --b {args.b} --rounds {args.rounds} "
               f"--name {args.name}")
    lines = [
        "---",
        f"date: {started}",
        f"machine: {describe_machine().label}, {len(os.sched_getaffinity(0))} cores",
        f"command: {command}",
        f"figures: B/A CPU a packrat status call {med['B'] / med['A']:.2f} "
        f"(A {med['A'] * 1000:.0f} ms, B {med['B'] * 1000:.0f} ms, medians)",
        "---",
        "",
        f"# `packrat status` cost: {args.name}",
        "",
        f"A = {commits['A']}, B = {commits['B']}; {args.rounds} rounds of A B B A, {2 * args.rounds} calls each, "
        f"against a stand-in controller answering {len(MODELS)} models (six requests a call).",
        "",
        "| commit | CPU a call, median (min-max) | wall a call, median (min-max) |",
        "|---|---|---|",
    ]
    for side in ("A", "B"):
        lines.append(f"| {side} {commits[side]} | {med[side] * 1000:.0f} ms ({min(cpu[side]) * 1000:.0f}-"
                     f"{max(cpu[side]) * 1000:.0f}) | {statistics.median(wall[side]) * 1000:.0f} ms "
                     f"({min(wall[side]) * 1000:.0f}-{max(wall[side]) * 1000:.0f}) |")
    lines += ["", f"B/A CPU a call: **{med['B'] / med['A']:.2f}**", ""]
    out = args.out_dir / f"cli-cost-{args.name}.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

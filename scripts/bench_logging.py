#!/usr/bin/env python
"""TorchServe's frontend logging, built-in against packrat/log4j2.xml, side by side.

Each round starts one TorchServe per configuration (alternating, so that drift hits
both), registers the no-op archive and DistilBERT (8 tokens, batch 1, one worker x all
cores, MODE), and sends --requests requests from one closed-loop client to each. Per
point: client p50/mean/p99, the frontend JVM's CPU time per request (utime + stime of
the java process, read from /proc around the measured requests) and the bytes its
logs grew by per request. Rows go to --out as they land; --report renders the table.

    python scripts/bench_logging.py --rounds 4 --out bench-out/logging.jsonl
    python scripts/bench_logging.py --report bench-out/logging.jsonl
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from packrat.bench.handler_code import handler_module
from packrat.bench.machine import describe_machine
from packrat.bench.mode_runs import Results, build_archive, last_run, load_mode

CONFIGS = {"torchserve": "torchserve", "packrat": ""}  # PACKRAT_TS_LOG_CONFIG per configuration


def java_cpu_ms(workdir: Path) -> float:
    """CPU time of the JVM whose working directory is `workdir` (TorchServe's frontend)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "java" not in Path(f"/proc/{pid}/comm").read_text() or \
                    os.readlink(f"/proc/{pid}/cwd") != str(workdir):
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return total * 1000 / os.sysconf("SC_CLK_TCK")


def log_bytes(workdir: Path) -> int:
    files = [*(workdir / "logs").glob("*.log"), workdir / "torchserve.out"]
    return sum(p.stat().st_size for p in files if p.exists())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="bf16-openvino")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--text-model", default="distilbert", help="e.g. tiny-distilbert for a smoke run")
    parser.add_argument("--out", type=Path, default=Path("bench-out/logging.jsonl"))
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    if args.report:
        print(render(args.report))
        return 0
    import torch

    from packrat.bench.loadgen import Target, closed_loop
    from packrat.server import start_torchserve

    sample_text = handler_module("packrat_tasks.text").sample_text

    results = Results(args.out)
    run = time.strftime("%Y%m%dT%H%M%S")
    cores = sorted(os.sched_getaffinity(0))
    results.add(run=run, kind="machine", cpu=describe_machine().cpu, cores=len(cores), torch=torch.__version__,
                load_avg=os.getloadavg(), command=" ".join(sys.argv))
    precision, runtime = args.mode.split("-")
    with tempfile.TemporaryDirectory(prefix="bench-logging-") as tmp:
        store = Path(tmp) / "store"
        text = args.text_model
        build_archive(text, store, "text", precision=precision, runtime=runtime, batch_size=1,
                      max_batch_delay_ms=0, workers=1, max_length=8,
                      extra={"plan_id": f"bench-logging-{os.getpid()}",
                             "slots": [{"cores": cores, "threads": len(cores)}]})
        build_archive("noop", store, "noop", batch_size=1, max_batch_delay_ms=0, workers=1)
        probe = load_mode(build_archive(text, store, "text-probe", max_length=8), "fp32-eager")
        body = sample_text(probe.tokenizer, 8).encode()
        del probe
        for r in range(args.rounds):
            for config, value in CONFIGS.items():
                workdir = Path(tmp) / f"ts-{config}-{r}"
                env = dict(os.environ)
                env.pop("PACKRAT_TS_LOG_CONFIG", None)
                if value:
                    env["PACKRAT_TS_LOG_CONFIG"] = value
                server = start_torchserve(store, workdir, env=env)
                try:
                    client = server.management_client()
                    token = server.inference_headers()["Authorization"].split(" ", 1)[1]
                    for name, payload, ctype in (("noop", b'{"x": 1}', "application/json"), ("text", body, "text/plain")):
                        client.register(name, name, 1, timeout_s=900)
                        target = Target(url=f"{server.inference_url}/predictions/{name}", body=payload,
                                        content_type=ctype, token=token)
                        closed_loop(target, clients=1, requests_count=50, warmup=10, max_duration_s=120)
                        cpu0, bytes0 = java_cpu_ms(workdir.resolve()), log_bytes(workdir)
                        res = closed_loop(target, clients=1, requests_count=args.requests, warmup=0,
                                          max_duration_s=300)
                        s = res.summary()
                        n = s["ok"] or 1
                        results.add(run=run, kind="point", round=r, config=config, model=name if name == "noop" else text,
                                    mode=args.mode if name == "text" else "-", p50_ms=s["p50_ms"], mean_ms=s["mean_ms"],
                                    p99_ms=s["p99_ms"], ok=s["ok"], errors=s["errors"],
                                    java_cpu_ms_per_request=round((java_cpu_ms(workdir.resolve()) - cpu0) / n, 3),
                                    log_bytes_per_request=round((log_bytes(workdir) - bytes0) / n, 1))
                finally:
                    server.stop()
    return 0


def render(path: Path) -> str:
    run, lines = last_run(path)
    points = [r for r in run if r["kind"] == "point"]
    lines += ["| model | frontend logging | p50 ms (per round) | median p50 | JVM CPU ms / request (median) | log bytes / request |",
              "|---|---|---|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in points):
        for config in CONFIGS:
            rows = [r for r in points if r["model"] == model and r["config"] == config]
            if not rows:
                continue
            p50s = [r["p50_ms"] for r in rows]
            lines.append(f"| {model} | {config} | {', '.join(f'{x:.2f}' for x in p50s)} | "
                         f"{statistics.median(p50s):.2f} | "
                         f"{statistics.median(r['java_cpu_ms_per_request'] for r in rows):.2f} | "
                         f"{statistics.median(r['log_bytes_per_request'] for r in rows):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

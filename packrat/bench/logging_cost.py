"""TorchServe's frontend logging, built-in against packrat/log4j2.xml, side by side
(scripts/bench_logging.py says what is measured).

Per point: client p50/mean/p99, the frontend JVM's CPU time per request and the bytes its
logs grew by per request; rows go to a JSONL file as they land, render() reads only it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from packrat.apply.swap import proc_cpu_ticks
from packrat.bench.handler_code import handler_module
from packrat.bench.loadgen import Target, closed_loop
from packrat.bench.machine import describe_machine
from packrat.bench.mode_runs import Results, build_archive, last_run, load_mode
from packrat.bench.proc_cpu import comm, pids, tick_ms
from packrat.server import RunningServer, start_torchserve
from packrat import settings

CONFIGS = {"torchserve": "torchserve", "packrat": ""}  # PACKRAT_TS_LOG_CONFIG per configuration


def java_cpu_ms(workdir: Path) -> float:
    """CPU time of the JVM whose working directory is `workdir` (TorchServe's frontend)."""
    total = 0
    for pid in pids():
        if "java" not in comm(pid):
            continue
        try:
            if os.readlink(f"/proc/{pid}/cwd") != str(workdir):
                continue
        except OSError:
            continue
        total += proc_cpu_ticks(pid) or 0
    return total * tick_ms()


def log_bytes(workdir: Path) -> int:
    files = [*(workdir / "logs").glob("*.log"), workdir / "torchserve.out"]
    return sum(p.stat().st_size for p in files if p.exists())


def measure(mode: str, rounds: int, requests: int, text: str, out: Path, command: str) -> None:
    """`rounds` rounds, each configuration's TorchServe in turn (drift hits both alike)."""
    import torch

    sample_text = handler_module("packrat_tasks.text").sample_text
    results = Results(out)
    run = time.strftime("%Y%m%dT%H%M%S")
    cores = sorted(os.sched_getaffinity(0))
    results.add(run=run, kind="machine", cpu=describe_machine().label, cores=len(cores), torch=torch.__version__,
                load_avg=os.getloadavg(), command=command)
    precision, runtime = mode.split("-")
    with tempfile.TemporaryDirectory(prefix="bench-logging-") as tmp:
        store = Path(tmp) / "store"
        build_archive(text, store, "text", precision=precision, runtime=runtime, batch_size=1,
                      max_batch_delay_ms=0, workers=1, max_length=8,
                      extra={"plan_id": f"bench-logging-{os.getpid()}",
                             "slots": [{"cores": cores, "threads": len(cores)}]})
        build_archive("noop", store, "noop", batch_size=1, max_batch_delay_ms=0, workers=1)
        probe = load_mode(build_archive(text, store, "text-probe", max_length=8), "fp32-eager")
        body = sample_text(probe.tokenizer, 8).encode()
        del probe
        for r in range(rounds):
            for config, value in CONFIGS.items():
                workdir = Path(tmp) / f"ts-{config}-{r}"
                env = dict(os.environ)
                env.pop(settings.get("ts_log_config").env, None)
                if value:
                    env[settings.get("ts_log_config").env] = value
                server = start_torchserve(store, workdir, env=env)
                try:
                    for name, payload, ctype in (("noop", b'{"x": 1}', "application/json"), ("text", body, "text/plain")):
                        point = _point(server, workdir, name, payload, ctype, requests)
                        results.add(run=run, kind="point", round=r, config=config,
                                    model=name if name == "noop" else text,
                                    mode=mode if name == "text" else "-", **point)
                finally:
                    server.stop()


def _point(server: RunningServer, workdir: Path, name: str, payload: bytes, ctype: str, requests: int) -> dict:
    """Register `name`, warm it, then `requests` from one client with the JVM's CPU and log bytes around them."""
    client = server.management_client()
    token = server.inference_headers()["Authorization"].split(" ", 1)[1]
    client.register(name, name, 1, timeout_s=900)
    target = Target(url=f"{server.inference_url}/predictions/{name}", body=payload, content_type=ctype, token=token)
    closed_loop(target, clients=1, requests_count=50, warmup=10, max_duration_s=120)
    cpu0, bytes0 = java_cpu_ms(workdir.resolve()), log_bytes(workdir)
    res = closed_loop(target, clients=1, requests_count=requests, warmup=0, max_duration_s=300)
    s = res.summary()
    n = s["ok"] or 1
    return {"p50_ms": s["p50_ms"], "mean_ms": s["mean_ms"], "p99_ms": s["p99_ms"], "ok": s["ok"],
            "errors": s["errors"],
            "java_cpu_ms_per_request": round((java_cpu_ms(workdir.resolve()) - cpu0) / n, 3),
            "log_bytes_per_request": round((log_bytes(workdir) - bytes0) / n, 1)}


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

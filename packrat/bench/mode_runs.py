"""What the execution-mode benchmarks share (scripts/bench_modes.py, bench_overhead.py,
bench_logging.py): a JSONL results file, timed in-process calls, archives built and loaded
in this process, and closed-loop B clients through TorchServe per worker shape.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

from packrat.archive import ArchiveOptions, build_named
from packrat.bench.handler_code import handler_module
from packrat.bench.loadgen import Target, closed_loop
from packrat.server import start_torchserve


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Results:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, **row) -> None:
        row["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        row["load_avg_1m"] = round(os.getloadavg()[0], 2)  # the machine is shared: say how busy
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log(json.dumps({k: v for k, v in row.items() if k not in ("guard", "build")}))


def time_calls(fn, budget_s: float, min_reps: int = 2, max_reps: int = 20, gap_s: float = 0.0) -> dict:
    """One warm-up call, then repeats until budget_s or max_reps (at least min_reps), each
    timed call after `gap_s` seconds idle (0: back to back)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return {"p50_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
            "reps": len(times)}


def build_archive(model: str, store: Path, name: str, **options) -> Path:
    return build_named(model, store, name, ArchiveOptions(**options), force=True)


def load_mode(archive: Path, mode: str, relax_guard: bool = False):
    packrat_handler = handler_module("packrat_handler")
    config = yaml.safe_load((archive / "model_config.yaml").read_text())
    precision, runtime = mode.split("-")
    config["packrat"].update(precision=precision, runtime=runtime)
    if relax_guard:  # measure speed only; the refusal is recorded beside it
        config["packrat"]["guard"] = {"min_top1_agreement": 0, "max_prob_diff": 1, "min_cosine": -1,
                                      "min_exact_fraction": 0}
    return packrat_handler.load_task(str(archive), config)


def rss_mb(pid: int) -> list[float] | None:
    """[current, peak] resident MiB of a worker process (peak: quantisation/compile included)."""
    got = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    got[line[:5]] = round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return [got.get("VmRSS"), got.get("VmHWM")]


def last_run(path: Path) -> tuple[list[dict], list[str]]:
    """The rows of the last run in a JSONL file, and the markdown lines naming its machine."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = rows[-1]["run"]
    rows = [r for r in rows if r.get("run") == run]
    machine = next((r for r in rows if r["kind"] == "machine"), {})
    return rows, [f"Run {run}: {machine.get('cpu')}, {machine.get('cores')} cores, torch {machine.get('torch')}, "
                  f"load average at start {machine.get('load_avg')}.", ""]


def request_body(model: str) -> tuple[bytes, str]:
    if "resnet" in model:
        return handler_module("packrat_tasks.image").sample_jpeg(), "image/jpeg"
    if "gpt2" in model:
        prompt = handler_module("packrat_tasks.generation").SAMPLE_PROMPT
        return json.dumps({"text": prompt, "max_new_tokens": 16}).encode(), "application/json"
    return None, "text/plain"  # filled from the archive's tokenizer


def bench_torchserve(model: str, mode: str, batches: list[int], results: Results, run: str,
                     workdir: Path, requests_per_b: int, body: bytes | None = None,
                     ctype: str = "text/plain", shapes=("fat", "thin"), max_length: int | None = None,
                     label: str = "torchserve", warm_s: float = 0.0, thin_below_cores: bool = False) -> None:
    """`thin_below_cores`: also measure thin (one 1-thread worker per core, cap
    max(1, b / cores)) at batches below the core count, where it is skipped by default.
    `warm_s`: seconds of load sent to each model before its measured requests, so the
    frontend's JIT compiler has settled (TorchServe's JVM compiles its request path over
    its first few thousand requests, on the cores the worker needs)."""
    cores = sorted(os.sched_getaffinity(0))
    store = workdir / "store"
    precision, runtime = mode.split("-")
    if body is None:
        archive = build_archive(model, store, f"{model}-probe", max_length=max_length)
        task = load_mode(archive, "fp32-eager")
        n = max_length or 128
        body = handler_module("packrat_tasks.text").sample_text(task.tokenizer, n).encode()
        del task
    names = []
    for b in batches:
        for shape in shapes:
            if shape == "thin" and ((b < len(cores) and not thin_below_cores) or len(cores) < 2):
                continue
            name = f"{model}-{mode}-{shape}-b{b}"
            extra = {}
            if shape == "thin":
                extra = {"plan_id": f"bench-{name}-{os.getpid()}",
                         "slots": [{"cores": [c], "threads": 1} for c in cores]}
            else:
                extra = {"plan_id": f"bench-{name}-{os.getpid()}",
                         "slots": [{"cores": cores, "threads": len(cores)}]}
            if "gpt2" in model:
                extra.update(max_new_tokens_cap=16)
            build_archive(model, store, name, precision=precision, runtime=runtime,
                          batch_size=b if shape == "fat" else max(1, b // len(cores)),
                          max_batch_delay_ms=5 if b > 1 else 0,
                          workers=1 if shape == "fat" else len(cores), max_length=max_length, extra=extra)
            names.append((name, b, shape))
    server = start_torchserve(store, workdir / "ts")
    try:
        client = server.management_client()
        token = server.inference_headers()["Authorization"].split(" ", 1)[1]
        for name, b, shape in names:
            client.register(name, name, 1 if shape == "fat" else len(cores), timeout_s=900)
            target = Target(url=f"{server.inference_url}/predictions/{name}", body=body,
                            content_type=ctype, token=token)
            if warm_s > 0:
                closed_loop(target, clients=b, requests_count=10**9, warmup=0, max_duration_s=warm_s)
            res = closed_loop(target, clients=b, requests_count=max(requests_per_b, 2 * b),
                              warmup=2 * b, max_duration_s=300)
            ok_ms = [r.latency_ms for r in res.records if r.ok]
            results.add(run=run, kind=label, model=model, mode=mode, batch=b, shape=shape, warm_s=warm_s,
                        min_ms=round(min(ok_ms), 3) if ok_ms else None,
                        **{k: v for k, v in res.summary().items() if k != "mode"})
            client.unregister(name, "1.0")
    finally:
        server.stop()

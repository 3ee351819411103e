"""Latency and throughput of each demo model through TorchServe: one client, batch 1
(scripts/bench_serving.py says how). serve() measures, report_md() writes the page.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from packrat.bench.loadgen import Target, closed_loop
from packrat.bench.machine import describe_machine
from packrat.server import start_torchserve


def long_text(words: int) -> str:
    base = ("The quick brown fox jumps over the lazy dog while the servers in the data centre "
            "answer thousands of requests about weather, travel, music and coffee. ").split()
    return " ".join((base * (words // len(base) + 1))[:words])


def jpeg(width: int = 640, height: int = 480) -> bytes:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@dataclass(frozen=True)
class Case:
    model: str
    what: str
    body: bytes
    content_type: str
    requests: int  # timed requests (after warm-up)


def cases(scale: float) -> list[Case]:
    def n(x: int) -> int:
        return max(10, int(x * scale))

    gen = b'{"text": "' + long_text(24).encode() + b'", "max_new_tokens": 16}'
    return [
        Case("noop", "echo of a 4-byte body, no model", b"ping", "application/octet-stream", n(1000)),
        Case("minilm", "~100-token sentence -> 384-d embedding", long_text(90).encode(), "text/plain", n(300)),
        Case("bert-base", "128-token text -> 2 labels (seq 128)", long_text(110).encode(), "text/plain", n(200)),
        Case("gpt2", "~30-token prompt -> 16 new tokens, greedy", gen, "application/json", n(40)),
        Case("resnet50", "640x480 JPEG -> top-5", jpeg(), "image/jpeg", n(150)),
    ]


def machine() -> dict[str, str]:
    import torch

    m = describe_machine()
    return {
        "cpu": m.label,
        "usable cores": str(m.cores),
        "memory": f"{m.memory_gib:.0f} GiB",
        "python": m.python,
        "torch": torch.__version__,
        "load average at start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def run_case(url: str, token: str, case: Case, warmup: int) -> dict:
    """One client, one request at a time: `warmup` unrecorded, then case.requests timed."""
    target = Target(url=url, body=case.body, content_type=case.content_type, token=token, timeout_s=300)
    res = closed_loop(target, clients=1, requests_count=case.requests, warmup=warmup)
    if res.errors:
        raise RuntimeError(f"{case.model}: {res.errors} of {res.requested} requests failed: {res.error_kinds}")
    return {"p50": res.p50_ms, "p99": res.p99_ms, "mean": res.mean_ms, "rps": res.throughput_rps, "n": res.ok}


def serve(model_store: Path, warmup: int, scale: float) -> tuple[dict[str, str], list[tuple[Case, dict]], list[str]]:
    """(machine, (case, result) per measured model, models without an archive in the store)."""
    todo = [c for c in cases(scale) if (model_store / c.model).is_dir()]
    missing = [c.model for c in cases(scale) if c not in todo]
    info = machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="packrat-bench-") as work:
        server = start_torchserve(model_store, Path(work))
        try:
            for c in todo:
                server.register(c.model)
            token = server.inference_headers()["Authorization"].split(" ", 1)[1]
            for c in todo:
                url = f"{server.inference_url}/predictions/{c.model}"
                res = run_case(url, token, c, warmup)
                rows.append((c, res))
                print(f"{c.model:<10} p50 {res['p50']:8.2f} ms  p99 {res['p99']:8.2f} ms  "
                      f"mean {res['mean']:8.2f} ms  {res['rps']:8.1f} req/s  (n={res['n']})", flush=True)
        finally:
            server.stop()
    info["load average at end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return info, rows, missing


def report_md(info: dict[str, str], rows: list[tuple[Case, dict]], missing: list[str], out: Path,
              scale: float) -> str:
    lines = [
        "# Serving benchmark: one client, batch 1, through TorchServe",
        "",
        "Produced by `scripts/bench_serving.py` (command below). Each model runs with",
        "one TorchServe worker, `batchSize` 1, eager fp32, torch's default thread",
        "count (no Packrat plan), token auth on, requests over loopback HTTP with",
        "keep-alive from one client thread. Latency is client-side wall time per",
        "request. `noop` has no model: it is TorchServe's own round trip (frontend,",
        "queue, worker socket, Python handler), the floor under every other row.",
        "",
        "Full-size models have **seeded random weights** (same shapes and compute as",
        "the real ones; outputs are meaningless); MiniLM is the real model.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        "- note: development machines are shared with other jobs; numbers are noisy.",
        "  A load average far above the core count means the server got a small",
        "  share of the CPU: absolute times are then inflated several-fold.",
        "",
        "## Results",
        "",
        "| model | input | requests | p50 ms | p99 ms | mean ms | req/s |",
        "|---|---|---:|---:|---:|---:|---:|",
        *[f"| {c.model} | {c.what} | {r['n']} | {r['p50']:.2f} | {r['p99']:.2f} | "
          f"{r['mean']:.2f} | {r['rps']:.1f} |" for c, r in rows],
        "",
    ]
    if missing:
        lines += [f"Not measured (no archive in the model store): {', '.join(missing)}", ""]
    lines += ["Command:", "", "```", ".venv/bin/python scripts/bench_serving.py "
              f"--out {out} --scale {scale}", "```", ""]
    return "\n".join(lines)

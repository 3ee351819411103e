"""TorchServe metric scrapes recorded while a stepped closed-loop load runs
(scripts/record_metrics.py): JSON lines {"t", "clients", "text"} that the estimator tests
replay (tests/data/observe/*.jsonl).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import requests

from packrat.bench.loadgen import Sent, Step, StepLoad
from packrat.observe.metrics import METRICS_QUERY


def key_headers(token: str | None, key_file: str | None) -> Callable[[], dict[str, str]]:
    """The inference key's header, read again from `key_file` before each request if given
    (survives a server restart, which issues new keys), else `token`."""
    def headers() -> dict[str, str]:
        key = token
        if key_file:
            try:
                with open(key_file) as f:
                    key = json.load(f)["inference"]["key"]
            except (OSError, ValueError, KeyError):
                pass  # mid-restart: send the old key; the 401 is recorded as such
        return {"Authorization": f"Bearer {key}"} if key else {}
    return headers


def record(metrics_url: str, predict_url: str, headers: Callable[[], dict[str, str]], steps: list[Step],
           interval_s: float, out: Path) -> list[Sent]:
    """Scrape every `interval_s` while the steps run; returns every request sent."""
    load = StepLoad(predict_url, steps, headers=headers).start()
    t0 = load.started_s
    with open(out, "w") as f:
        while load.running:
            t = time.monotonic()
            try:
                text = requests.get(f"{metrics_url}/metrics?{METRICS_QUERY}", timeout=5).text
            except requests.RequestException as exc:
                # A restarting server: record the gap as it is.
                text = f"# scrape failed: {exc!r}"
            f.write(json.dumps({"t": round(t - t0, 3), "clients": load.level, "text": text}) + "\n")
            f.flush()
            time.sleep(max(0.0, interval_s - (time.monotonic() - t)))
    return load.join()

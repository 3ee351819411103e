"""A burst of concurrent requests larger than TorchServe's default job queue (100 a model)
is queued and answered, not refused: config.properties sets job_queue_size. A model that
sleeps its batch's table latency keeps the queue full without using the CPU."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import requests
import yaml

from serving_support import start_server, stop_in_background

pytestmark = [pytest.mark.torchserve]

SLEEP_MODEL = Path(__file__).parent / "data" / "observe" / "sleepmodel"
BATCH = 8
BURST = 300  # well above 100 + one batch in the worker


@pytest.fixture
def burst_store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(SLEEP_MODEL, store / "burst")
    cfg_path = store / "burst" / "model_config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg.update(batchSize=BATCH, maxBatchDelay=5)
    cfg["packrat"]["sleep_ms"] = {1: {1: 150, BATCH: 150}}  # 300 requests: ~38 batches, ~6 s
    cfg_path.write_text(yaml.safe_dump(cfg))
    return store


def test_a_burst_beyond_torchserve_s_default_queue_is_answered(burst_store: Path, tmp_path: Path) -> None:
    server = start_server(burst_store, tmp_path / "ts")
    try:
        server.register("burst")
        url, headers = f"{server.inference_url}/predictions/burst", server.inference_headers()
        go, lock = threading.Event(), threading.Lock()
        statuses: list[int] = []
        failures: list[str] = []

        def send() -> None:
            go.wait()
            r = requests.post(url, data=b"x", headers=headers, timeout=120)
            with lock:
                statuses.append(r.status_code)
                if r.status_code != 200:
                    failures.append(r.text[:200])

        clients = [threading.Thread(target=send) for _ in range(BURST)]
        for c in clients:
            c.start()
        go.set()
        for c in clients:
            c.join(timeout=180)
        assert len(statuses) == BURST
        assert statuses.count(200) == BURST, (statuses.count(200), failures[:2])
    finally:
        stop_in_background(server)

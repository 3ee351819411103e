"""Helpers for serving tests: start a server, register once per server, predict, worker pids."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from packrat.server import RunningServer, start_torchserve


def start_server(model_store: Path, workdir: Path, **kwargs) -> RunningServer:
    """start_torchserve with the server's own slot directory (inside `workdir`,
    removed by stop()): no test server sees another's slot locks or status files.
    Whatever reads its workers' status files (a Swapper in the test process, a
    controller subprocess) must use PACKRAT_SLOT_DIR=server.slot_dir."""
    return start_torchserve(model_store, workdir, slot_dir=Path(workdir) / "slots", **kwargs)


def ensure_registered(server: RunningServer, *names: str) -> None:
    """Register the archives not yet loaded, in parallel: each worker spends ~5-10 s
    importing torch/transformers, and TorchServe loads models concurrently."""
    loaded = {m["modelName"] for m in server.management_client().list_models()}
    todo = [n for n in names if n not in loaded]
    if todo:
        with ThreadPoolExecutor(len(todo)) as pool:
            for f in [pool.submit(server.register, n) for n in todo]:
                f.result()


def worker_pids(server: RunningServer, name: str) -> list[int]:
    return [w["pid"] for w in server.management_client().describe(name)["workers"]]


def predict(server: RunningServer, name: str, body: bytes | None = None, json: object = None,
            headers: dict[str, str] | None = None) -> requests.Response:
    h = server.inference_headers()
    h.update(headers or {})
    return requests.post(f"{server.inference_url}/predictions/{name}", data=body, json=json,
                         headers=h, timeout=120)


def predict_together(server: RunningServer, name: str, payloads: list[dict]) -> list[requests.Response]:
    """Send all payloads at once (one thread each) so TorchServe can batch them."""
    with ThreadPoolExecutor(len(payloads)) as pool:
        futures = [pool.submit(predict, server, name, **p) for p in payloads]
        return [f.result() for f in futures]

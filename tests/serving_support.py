"""Helpers for serving tests: register once per server, predict, worker pids."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests

from packrat.apply.server import RunningServer


def ensure_registered(server: RunningServer, *names: str) -> None:
    client = server.management_client()
    loaded = {m["modelName"] for m in client.list_models()}
    for name in names:
        if name not in loaded:
            client.register(name, name, 1)


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

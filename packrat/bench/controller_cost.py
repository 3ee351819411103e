"""What the controller costs (issue 35 item 4): its CPU seconds per wall second while one
of five models is under load and four are idle.

One private TorchServe with five copies of the sleep model (each worker sleeps a table
latency per batch: no torch work, so the machine's two cores stay for what is measured),
the controller as users run it (`packrat controller`, re-planning on, tuning off: a tune
profiles, which is work the operator asked for, not the controller's upkeep) and
`clients` closed-loop clients on the first model. Optionally one status-page tab
(GET /v1/models/<m>/status of every model every 5 s, as the page polls).

The controller's utime + stime is read from /proc/<pid>/stat at the start and end of
the measured window: CPU seconds per wall second means the same on a busy machine as on
a quiet one (the load average is recorded beside it, as a busy machine still slows the
wall clock of what it measures a little). One JSON object is returned; summary() renders
it as a markdown table row.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from packrat import settings as packrat_settings
from packrat.apply.client import session_for
from packrat.apply.swap import proc_cpu_ticks
from packrat.bench.adapt_rig import free_port, sleep_table, table_profile
from packrat.bench.loadgen import Target, closed_loop
from packrat.bench.machine import describe_machine
from packrat.bench.proc_cpu import tick_ms
from packrat.bench.sleepmodel import SLEEP_MODEL, copy_sleep_model
from packrat.profile.store import save_profile

MODELS = ("m1", "m2", "m3", "m4", "m5")
STATUS_POLL_S = 5.0  # the status page's poll period, per tab


def _controller_cmd(server: Any, state: Path, port: int) -> list[str]:
    exe = Path(sys.executable).with_name("packrat")
    packrat = [str(exe)] if exe.exists() else [sys.executable, "-m", "packrat.cli"]
    return [*packrat, "controller", "--management-url", server.management_url,
            "--metrics-url", server.metrics_url, "--key-file", str(server.key_file),
            "--model-store", str(server.model_store), "--state-dir", str(state),
            "--port", str(port), "--no-tune"]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the controller exited ({proc.returncode})")
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise RuntimeError("the controller did not become healthy")


def _poll_status(url: str, headers: dict[str, str], stop: threading.Event, counts: list[int]) -> None:
    """One status-page tab: every model's status every STATUS_POLL_S."""
    while not stop.wait(STATUS_POLL_S):
        for m in MODELS:
            try:
                with session_for(url) as direct:  # a new connection each, as before; never via a proxy
                    direct.get(f"{url}/v1/models/{m}/status", headers=headers, timeout=30)
                counts[0] += 1
            except requests.RequestException:
                counts[1] += 1


def _window(pid: int, seconds: float) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of process `pid` over `seconds`."""
    t0, c0 = time.monotonic(), proc_cpu_ticks(pid)
    time.sleep(seconds)
    t1, c1 = time.monotonic(), proc_cpu_ticks(pid)
    if c0 is None or c1 is None:
        raise RuntimeError("the controller exited during the window")
    return (c1 - c0) * tick_ms() / 1000.0, t1 - t0


def measure(clients: int, seconds: float, settle_s: float, status_tab: bool, command: str) -> dict[str, Any]:
    """Start everything, load the first model, measure the controller over `seconds`."""
    from packrat.server import start_torchserve

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what we started (finally)
    with tempfile.TemporaryDirectory(prefix="packrat-ctlcost-") as tmp:
        root = Path(tmp)
        store, state = root / "store", root / "state"
        store.mkdir()
        (state / "profiles").mkdir(parents=True)
        profile = table_profile("sleepy", sleep_table(SLEEP_MODEL))
        for m in MODELS:
            copy_sleep_model(store, m)
            save_profile(profile, state / "profiles" / f"{m}.json")
        env = {packrat_settings.get("slot_dir").env: str(root / "slots")}
        server = start_torchserve(store, root / "ts", slot_dir=root / "slots",
                                  extra_properties={"token_expiration_min": "480"})
        proc = None
        try:
            for m in MODELS:
                server.register(m, 1)
            port = free_port()
            proc = subprocess.Popen(_controller_cmd(server, state, port), env={**os.environ, **env},
                                    stdout=subprocess.DEVNULL, stderr=open(root / "controller.log", "w"),
                                    start_new_session=True)
            api = f"http://127.0.0.1:{port}"
            _wait_healthy(api, proc)
            return _loaded_window(server, api, proc.pid, clients, seconds, settle_s, status_tab, command)
        finally:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
            server.stop()
            shutil.rmtree(root / "slots", ignore_errors=True)


def _loaded_window(server: Any, api: str, pid: int, clients: int, seconds: float, settle_s: float,
                   status_tab: bool, command: str) -> dict[str, Any]:
    target = Target(f"{server.inference_url}/predictions/{MODELS[0]}", b"x", "application/octet-stream",
                    server.keys.inference.key, timeout_s=120.0)
    result: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: result.update(
        closed_loop(target, clients, 10_000_000, warmup=clients,
                    max_duration_s=settle_s + seconds + 5).summary()), daemon=True)
    stop, polls = threading.Event(), [0, 0]
    poller = threading.Thread(target=_poll_status, args=(api, server.management_headers(), stop, polls),
                              daemon=True)
    loader.start()
    if status_tab:
        poller.start()
    time.sleep(settle_s)
    load_before = os.getloadavg()
    cpu_s, wall_s = _window(pid, seconds)
    load_after = os.getloadavg()
    stop.set()
    loader.join()
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command,
            "cpu": describe_machine().label, "cpus": os.cpu_count(), "models": len(MODELS),
            "loaded_model_clients": clients, "status_tab": status_tab, "window_s": round(wall_s, 1),
            "controller_cpu_s": round(cpu_s, 2), "controller_core_pct": round(100.0 * cpu_s / wall_s, 2),
            "loadavg_1m": [load_before[0], load_after[0]], "status_calls": polls[0],
            "status_errors": polls[1], "load": {k: result.get(k) for k in ("throughput_rps", "p50_ms",
                                                                              "errors")}}


def summary(rec: dict[str, Any], label: str) -> str:
    """One markdown table row: | label | core % | CPU s / window | load avg | load served |."""
    ld = rec["load"]
    return (f"| {label} | {rec['controller_core_pct']:.2f} % | {rec['controller_cpu_s']:.2f} s / "
            f"{rec['window_s']:.0f} s | {rec['loadavg_1m'][0]:.1f} -> {rec['loadavg_1m'][1]:.1f} | "
            f"{'yes' if rec['status_tab'] else 'no'} | {ld['throughput_rps'] or 0:.1f} req/s, "
            f"{ld['errors'] or 0} errors |")

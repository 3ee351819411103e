"""A live adaptation rig: TorchServe + controller + re-plan loop on loopback.

Used by the integration test (tests/test_observe_adapt.py) and by
scripts/adapt_trace.py: start a private TorchServe (token auth on), register
a model, put its profile where the controller looks, run the controller's
tick loop with an AdaptiveLoop in a thread, and optionally its REST API;
stop all of it on exit, also after a failure.

Or attach to a TorchServe already running (`server=`, e.g. one a user started, or one
shared by several runs): the rig copies its models into that server's model store,
and on exit unregisters every version of them and removes what it copied, leaving
the server running as it found it. Its controller must read the server's workers'
slot directory (PACKRAT_SLOT_DIR = server.slot_dir).
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from packrat.server import RunningServer, start_torchserve
from packrat.observe.loop import AdaptiveLoop, AdaptSettings
from packrat.types import Plan, Profile, ProfilePoint


def table_profile(model_id: str, table: dict[int, dict[int, float]]) -> Profile:
    """A Profile from {threads: {batch: ms}} (e.g. the sleep model's own table)."""
    points = tuple(ProfilePoint(int(t), int(b), float(ms))
                   for t, row in sorted(table.items()) for b, ms in sorted(row.items()))
    return Profile(model_id=model_id, points=points, scope="handler",
                   extra={"model_name": model_id, "settings": {"source": "table"}})


def sleep_table(model_dir: Path) -> dict[int, dict[int, float]]:
    cfg = yaml.safe_load((model_dir / "model_config.yaml").read_text())
    return {int(t): {int(b): float(ms) for b, ms in row.items()}
            for t, row in cfg["packrat"]["sleep_ms"].items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Sample:
    """What the loop saw at one moment (for traces)."""

    time_s: float
    estimated_batch: int | None
    concurrency: float | None
    active_batch: int | None
    active_workers: list | None
    reason: str | None
    version: str | None


@dataclass
class Rig:
    store: Path
    workdir: Path
    model: str
    base_dir: Path  # a model directory to copy into the store as the base
    profile: Profile
    settings: AdaptSettings = field(default_factory=AdaptSettings)
    cores: tuple[int, ...] = (0, 1)
    tick_s: float = 1.0
    rest: bool = False
    server: RunningServer | None = None
    controller: Any = None
    loop: AdaptiveLoop | None = None
    api_url: str | None = None
    samples: list[Sample] = field(default_factory=list)
    decision_log: list[dict] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _uvicorn: Any = None
    _attached: bool = False  # the server was given: left running, only our models removed
    _models: list[str] = field(default_factory=list)  # registered by this rig, in order

    def __enter__(self) -> "Rig":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        from packrat.control import Controller, ControllerSettings
        from packrat.profile.store import save_profile

        if self.server is not None:
            # Attached: the models go where the running server looks for them.
            self._attached = True
            self.store = Path(self.server.model_store)
        self.store.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.base_dir, self.store / self.model, symlinks=True)
        if self.server is None:
            self.server = start_torchserve(self.store, self.workdir / "torchserve")
        self._models.append(self.model)
        self.server.management_client().register(self.model, self.model, 1)
        state_dir = self.workdir / "packrat-state"
        settings = ControllerSettings(
            management_url=self.server.management_url,
            key_file=self.server.key_file,
            model_store=self.store,
            metrics_url=self.server.metrics_url,
            state_dir=state_dir,
            cores=self.cores,
            tick_s=self.tick_s,
        )
        # Every decision, in order (the loop itself keeps only the last few).
        self.loop = AdaptiveLoop(self.settings, emit=lambda line: self.decision_log.append(json.loads(line)))
        self.controller = Controller(settings, policy=self.loop)
        self.controller.acquire()
        save_profile(self.profile, self.controller.profile_path(self.model))

    def register(self, name: str, workers: int = 1) -> None:
        """Register archive `name` (already in the store) and wait for its workers; removed on
        exit when attached."""
        self._models.append(name)
        self.server.register(name, workers)

    # -- running ---------------------------------------------------------------------
    def apply(self, plan: Plan) -> Any:
        return self.controller.apply(self.model, plan)

    def start_loop(self, sample_every_s: float = 0.5) -> None:
        t = threading.Thread(target=self.controller.run, args=(self._stop,), daemon=True,
                             name="controller-tick")
        t.start()
        self._threads.append(t)
        s = threading.Thread(target=self._sample, args=(sample_every_s,), daemon=True,
                             name="rig-sampler")
        s.start()
        self._threads.append(s)
        if self.rest:
            self._start_rest()

    def _sample(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            last = self.loop.last_decisions(self.model, last=1) if self.loop else []
            d = last[-1] if last else None
            try:
                version = self.controller.client.describe(self.model)["modelVersion"]
            except Exception:  # noqa: BLE001 - mid-swap describe may fail; the sample just lacks it
                version = None
            self.samples.append(Sample(
                time_s=time.time(),
                estimated_batch=d.estimated_batch if d and d.estimate.ready else None,
                # rounded as a decision line rounds it (the trace's samples read as before)
                concurrency=(None if d is None or d.estimate.concurrency is None
                             else round(d.estimate.concurrency, 4)),
                active_batch=d.active_batch if d else None,
                active_workers=None if not d else self._active_workers(),
                reason=d.reason if d else None,
                version=version,
            ))

    def _active_workers(self) -> list | None:
        try:
            st = self.controller.model_state(self.model)
        except Exception:  # noqa: BLE001
            return None
        return [list(w) for w in st.plan.shape] if st.plan else None

    def _start_rest(self) -> None:
        import uvicorn

        from packrat.api import create_app
        from packrat.api.server import api_config

        port = free_port()
        self._uvicorn = uvicorn.Server(api_config(create_app(self.controller), "127.0.0.1", port))
        t = threading.Thread(target=self._uvicorn.run, daemon=True, name="rest")
        t.start()
        self._threads.append(t)
        self.api_url = f"http://127.0.0.1:{port}"
        import requests

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                requests.get(f"{self.api_url}/metrics", timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("controller REST API did not come up")

    def close(self) -> None:
        self._stop.set()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        for t in self._threads:
            t.join(timeout=60)
        if self.controller is not None:
            self.controller.release()
        if self.server is not None and self._attached:
            for name in reversed(self._models):
                remove_model(self.server, self.store, name)
        elif self.server is not None:
            self.server.stop()


def remove_model(server: RunningServer, store: Path, name: str, base: bool = True) -> None:
    """Every version of `name` unregistered and its version directories removed from `store`
    (also any left unregistered), and the base archive (a copy, or a link to one) too unless
    `base` is False."""
    from packrat.apply import versions

    versions.unregister_every_version(server.management_client(), store, name, keep=name)
    for path in store.glob(f"{name}.*"):
        if (path / versions.MANIFEST).exists() and versions.load_version(path):
            versions.remove_version(path)  # its links only, never what they point at
    if base and (store / name).is_symlink():
        (store / name).unlink()  # the link only, never the archive it names
    elif base:
        shutil.rmtree(store / name, ignore_errors=True)

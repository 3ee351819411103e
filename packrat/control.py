"""The controller: owns the live plans of one TorchServe, its clock and its state dir.

It attaches to a running TorchServe and never assumes it started it, so it can
be killed and restarted at any time without disturbing serving:

- what is live is read back from TorchServe (default version of each model)
  and from the version directory it was registered from (the plan travels in
  its model_config.yaml);
- what TorchServe does not know lives in the state dir (`.packrat/` by default):
    swaps.jsonl        one line per swap attempt (durations, outcome, error)
    policy-state.json  the re-plan policy's state, per model
    profiles/<m>.json  profiles made through the REST API
    controller.lock    flock: one controller per state dir
- on attach it finishes what a killed controller left half done: a Packrat
  version that is loaded but not the default is drained and unregistered, and
  version directories no version was registered from are deleted.

The re-plan decision is not made here. `tick()` hands a TickContext to an
injected pure policy `(context) -> (plan or None, new state)` and persists the
state it returns (after Ray Serve's autoscaling policy), so the policy can be
tested by calling it and resumes after a restart.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from packrat.apply import versions
from packrat.apply.client import ManagementClient
from packrat.apply.swap import SwapRecord, Swapper, SwapSettings, check_workers
from packrat.errors import ConfigError, PackratError, TorchServeError
from packrat.observe import metrics
from packrat.types import Observation, Plan

DEFAULT_STATE_DIR = Path(".packrat")
HISTORY_FILE = "swaps.jsonl"
POLICY_STATE_FILE = "policy-state.json"


@dataclass(frozen=True)
class ControllerSettings:
    management_url: str
    key_file: Path
    model_store: Path
    metrics_url: str | None = None  # observed latency in status; none when unset
    state_dir: Path = DEFAULT_STATE_DIR
    cores: tuple[int, ...] | None = None  # usable cores; default: this process's affinity
    tick_s: float = 5.0  # how often the policy runs (when one is set)
    swap: SwapSettings = field(default_factory=SwapSettings)


@dataclass(frozen=True)
class TickContext:
    """What a re-plan policy sees at one tick (all of it read, none of it to mutate)."""

    now: float
    model: str
    version: str
    plan: Plan | None
    observation: Observation | None
    cores: int
    profile_path: Path | None
    swap_in_progress: bool = False  # a swap (e.g. one started over REST) is running


# A policy decides from the context and its own state whether to apply a new plan.
Policy = Callable[[TickContext, dict[str, Any]], tuple[Plan | None, dict[str, Any]]]


@dataclass(frozen=True)
class ModelState:
    model: str
    version: str
    url: str
    plan: Plan | None  # None: a plain version Packrat did not create
    workers: tuple[dict[str, Any], ...]
    other_versions: tuple[str, ...]


class Controller:
    def __init__(
        self,
        settings: ControllerSettings,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.clock = clock
        self.state_dir = Path(settings.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "profiles").mkdir(exist_ok=True)
        self.client = ManagementClient(settings.management_url, settings.key_file)
        self.cores: list[int] = (
            list(settings.cores) if settings.cores is not None else sorted(os.sched_getaffinity(0))
        )
        self.swapper = Swapper(self.client, settings.model_store, self.cores, settings.swap)
        # One swap at a time per controller (REST calls and ticks share it).
        self._swap_lock = threading.Lock()
        self._lock_fd: int | None = None
        self._last_metrics: dict[str, tuple[float, float, float]] = {}
        self.running_swap: SwapRecord | None = None

    # -- lifecycle ------------------------------------------------------------
    def acquire(self) -> None:
        """Take the state dir's lock: a second controller on the same state would race swaps."""
        fd = os.open(self.state_dir / "controller.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise ConfigError(f"another controller holds {self.state_dir}/controller.lock") from exc
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def attach(self) -> list[str]:
        """Read what is live and finish half-done swaps; returns what was cleaned up."""
        cleaned: list[str] = []
        for m in self.client.list_models():
            name = m["modelName"]
            default_version, _ = self.swapper.current(name)
            registered_urls = set()
            for d in self.client.describe_all(name):
                registered_urls.add(d["modelUrl"])
                v = d["modelVersion"]
                if v == default_version:
                    continue
                path = self.settings.model_store / d["modelUrl"]
                if (path / versions.MANIFEST).exists() and versions.load_version(path) is not None:
                    # Left over by a killed swap: new-but-not-default, or old-not-yet-unregistered.
                    self.swapper.drain(name, v)
                    self.client.unregister(name, v)
                    self.swapper.retire_dir(d["modelUrl"])
                    cleaned.append(f"{name} {v}")
            # Version dirs of this model that nothing is registered from: a swap died before register.
            for path in self.settings.model_store.glob(f"{name}.p*"):
                if path.name not in registered_urls and (path / versions.MANIFEST).exists():
                    if versions.load_version(path) is not None:
                        versions.remove_version(path)
                        cleaned.append(str(path.name))
        return cleaned

    # -- reading state ------------------------------------------------------------
    def models(self) -> list[str]:
        return [m["modelName"] for m in self.client.list_models()]

    def model_state(self, model: str) -> ModelState:
        d = self.client.describe(model)
        path = self.settings.model_store / d["modelUrl"]
        vdir = versions.load_version(path) if (path / versions.MANIFEST).exists() else None
        others = tuple(
            x["modelVersion"] for x in self.client.describe_all(model) if x["modelVersion"] != d["modelVersion"]
        )
        workers = d.get("workers", [])
        if vdir is not None:
            checks = {c.pid: c for c in check_workers(d, vdir)}
            workers = [
                {
                    **w,
                    "slot": checks[w["pid"]].slot if w["pid"] in checks else None,
                    "cores": list(checks[w["pid"]].cores or ()) if w["pid"] in checks else None,
                    "affinity": list(checks[w["pid"]].affinity or ()) if w["pid"] in checks else None,
                    "torch_threads": checks[w["pid"]].torch_threads if w["pid"] in checks else None,
                    "as_planned": checks[w["pid"]].ok if w["pid"] in checks else False,
                }
                for w in workers
            ]
        return ModelState(
            model=model,
            version=d["modelVersion"],
            url=d["modelUrl"],
            plan=vdir.plan if vdir else None,
            workers=tuple(workers),
            other_versions=others,
        )

    def history(self, model: str | None = None, last: int = 20) -> list[dict[str, Any]]:
        path = self.state_dir / HISTORY_FILE
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if model is None or rec.get("model") == model:
                out.append(rec)
        return out[-last:]

    def observe(self, model: str) -> Observation | None:
        """Cumulative request count and latency of `model` from TorchServe's metrics port.

        Summed over the version labels: unversioned traffic is labelled "default"
        whichever version serves it.
        """
        if not self.settings.metrics_url:
            return None
        url = f"{self.settings.metrics_url.rstrip('/')}/metrics"
        try:
            text = requests.get(url, timeout=5).text
        except requests.RequestException as exc:
            raise TorchServeError("GET", url, 0, f"unreachable: {exc}") from exc
        return metrics.observation(text, model, self.clock())

    def observed_latency(self, model: str) -> dict[str, Any] | None:
        """Mean latency (ms) overall and since the previous call, from counter deltas."""
        obs = self.observe(model)
        if obs is None:
            return None
        prev = self._last_metrics.get(model)
        self._last_metrics[model] = (obs.time_s, obs.requests_total, obs.latency_us_total)
        out: dict[str, Any] = {
            "requests_total": obs.requests_total,
            "mean_latency_ms": (obs.latency_us_total / obs.requests_total / 1000.0) if obs.requests_total else None,
            "recent_mean_latency_ms": None,
            "recent_window_s": None,
        }
        if prev is not None:
            dt, dn, dl = obs.time_s - prev[0], obs.requests_total - prev[1], obs.latency_us_total - prev[2]
            if dn > 0:
                out["recent_mean_latency_ms"] = dl / dn / 1000.0
            out["recent_window_s"] = round(dt, 3)
        return out

    def status(self, model: str) -> dict[str, Any]:
        st = self.model_state(model)
        return {
            "model": model,
            "version": st.version,
            "url": st.url,
            "plan": versions.plan_to_dict(st.plan) if st.plan else None,
            # 0 means "not predicted" (an explicit plan applied without a profile).
            "predicted_latency_ms": (st.plan.predicted_latency_ms or None) if st.plan else None,
            "observed": self.observed_latency(model),
            "workers": list(st.workers),
            "other_versions": list(st.other_versions),
            "swap_in_progress": self.running_swap.to_dict() if self.running_swap else None,
            "last_swaps": self.history(model, last=10),
            # The re-plan loop's view (estimated B, last decisions), if it runs.
            "adapt": self.policy.status(model) if hasattr(self.policy, "status") else None,
        }

    # -- acting -------------------------------------------------------------------
    def swap_busy(self) -> bool:
        return self._swap_lock.locked()

    def apply(self, model: str, plan: Plan) -> SwapRecord:
        """Swap `model` to `plan` (one swap at a time); the attempt is recorded whatever happens."""
        if not self._swap_lock.acquire(blocking=False):
            raise ConfigError("a swap is already running; try again when it is done")
        try:
            versions.validate_plan(plan, len(self.cores))
            self.swapper.current(model)  # TorchServeError 404 for an unknown model, before anything
            started = self.clock()
            self.running_swap = SwapRecord(model, None, None, versions.plan_to_dict(plan), started)
            try:
                record = self.swapper.apply(model, plan)
            except PackratError as exc:
                rec = getattr(exc, "record", None)
                if rec is not None:
                    self._append_history(rec.to_dict())
                raise
            self._append_history(record.to_dict())
            return record
        finally:
            self.running_swap = None
            self._swap_lock.release()

    def _append_history(self, rec: dict[str, Any]) -> None:
        # Append + fsync per line: a crash loses at most the line being written.
        with open(self.state_dir / HISTORY_FILE, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # -- the policy seam -------------------------------------------------------------
    def policy_state(self) -> dict[str, Any]:
        path = self.state_dir / POLICY_STATE_FILE
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def _save_policy_state(self, state: dict[str, Any]) -> None:
        path = self.state_dir / POLICY_STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, default=str))
        os.replace(tmp, path)

    def profile_path(self, model: str) -> Path:
        return self.state_dir / "profiles" / f"{model}.json"

    def tick(self) -> list[SwapRecord]:
        """One round of the policy over every model; applies the plans it asks for."""
        if self.policy is None:
            return []
        done: list[SwapRecord] = []
        all_state = self.policy_state()
        for model in self.models():
            st = self.model_state(model)
            profile = self.profile_path(model)
            ctx = TickContext(
                now=self.clock(),
                model=model,
                version=st.version,
                plan=st.plan,
                observation=self.observe(model),
                cores=len(self.cores),
                profile_path=profile if profile.exists() else None,
                swap_in_progress=self.running_swap is not None,
            )
            new_plan, all_state[model] = self.policy(ctx, all_state.get(model, {}))
            self._save_policy_state(all_state)
            if new_plan is not None:
                try:
                    done.append(self.apply(model, new_plan))
                except PackratError:
                    pass  # recorded in the history; the next tick decides again
        return done

    def run(self, stop: threading.Event) -> None:
        """Tick until `stop` is set (the REST server runs beside it in another thread)."""
        while not stop.wait(self.settings.tick_s):
            try:
                self.tick()
            except PackratError:
                continue  # TorchServe busy or restarting: try again next tick



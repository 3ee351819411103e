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

The re-plan decision is not made here. `tick()` hands a packrat.types.TickContext
to an injected packrat.types.Policy `(context, state) -> (plan or None, new state)`
and persists the state it returns (after Ray Serve's autoscaling policy), so
the policy can be tested by calling it and resumes after a restart.

What the REST API and the CLI ask (status, plans, profile jobs) is answered
here with typed values (ModelState, ModelStatus, Plan, SwapRecord, Job); they
only parse and render.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packrat.apply import versions
from packrat.apply.client import ManagementClient, scrape_metrics
from packrat.apply.swap import Swapper, SwapSettings, WorkerCheck, check_workers
from packrat.errors import BusyError, ConfigError, PackratError, ProfileError, SwapError
from packrat.jobs import Job, Jobs
from packrat.observe import metrics
from packrat.plan import plan_from_shape, realizable_plan
from packrat.profile import ProfileSettings, load_profile, open_archive, run_profile, save_profile
from packrat.types import Observation, Plan, Policy, Profile, SwapRecord, TickContext

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
class WorkerState:
    """One worker as TorchServe describes it, and whether it runs as its slot says."""

    described: dict[str, Any]  # TorchServe's own fields (id, pid, status, memoryUsage, ...)
    check: WorkerCheck | None  # None: a version Packrat did not create (no slots to check)


@dataclass(frozen=True)
class ModelState:
    model: str
    version: str
    url: str
    plan: Plan | None  # None: a plain version Packrat did not create
    workers: tuple[WorkerState, ...]
    other_versions: tuple[str, ...]


@dataclass(frozen=True)
class ObservedLatency:
    """TorchServe's counters for one model: overall, and since the previous reading."""

    requests_total: float
    mean_latency_ms: float | None
    recent_mean_latency_ms: float | None = None
    recent_window_s: float | None = None


@dataclass(frozen=True)
class ModelStatus:
    state: ModelState
    observed: ObservedLatency | None
    swap_in_progress: SwapRecord | None
    last_swaps: tuple[dict[str, Any], ...]  # swaps.jsonl lines of this model
    adapt: dict[str, Any] | None  # the re-plan loop's view, if it runs


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
        self._last_observation: dict[str, Observation] = {}
        self.running_swap: SwapRecord | None = None
        self.jobs = Jobs()

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
    def management_key(self) -> str | None:
        """TorchServe's management key as key_file.json holds it now (the REST API's token)."""
        keys = self.client.keys()
        return keys.management.key if keys else None

    def models(self) -> list[str]:
        return [m["modelName"] for m in self.client.list_models()]

    def model_state(self, model: str) -> ModelState:
        d = self.client.describe(model)
        path = self.settings.model_store / d["modelUrl"]
        vdir = versions.load_version(path) if (path / versions.MANIFEST).exists() else None
        others = tuple(
            x["modelVersion"] for x in self.client.describe_all(model) if x["modelVersion"] != d["modelVersion"]
        )
        checks = {c.pid: c for c in check_workers(d, vdir)} if vdir is not None else {}
        workers = tuple(WorkerState(w, checks.get(w.get("pid"))) for w in d.get("workers", []))
        return ModelState(
            model=model,
            version=d["modelVersion"],
            url=d["modelUrl"],
            plan=vdir.plan if vdir else None,
            workers=workers,
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
        return metrics.observation(scrape_metrics(self.settings.metrics_url), model, self.clock())

    def observed_latency(self, model: str) -> ObservedLatency | None:
        """Mean latency (ms) overall and since the previous call, from counter deltas."""
        obs = self.observe(model)
        if obs is None:
            return None
        prev = self._last_observation.get(model)
        self._last_observation[model] = obs
        overall = (obs.latency_us_total / obs.requests_total / 1000.0) if obs.requests_total else None
        if prev is None:
            return ObservedLatency(obs.requests_total, overall)
        recent = metrics.window_means(prev, obs)
        return ObservedLatency(obs.requests_total, overall, recent.mean_latency_ms,
                               round(obs.time_s - prev.time_s, 3))

    def status(self, model: str) -> ModelStatus:
        return ModelStatus(
            state=self.model_state(model),
            observed=self.observed_latency(model),
            swap_in_progress=self.running_swap,
            last_swaps=tuple(self.history(model, last=10)),
            adapt=self.policy.status(model) if self.policy is not None else None,
        )

    # -- plans and profiles ---------------------------------------------------------
    def profile_path(self, model: str) -> Path:
        return self.state_dir / "profiles" / f"{model}.json"

    def profile(self, model: str) -> Profile:
        """The profile the controller plans `model` from; ProfileError when there is none."""
        path = self.profile_path(model)
        if not path.exists():
            raise ProfileError(
                f"no profile for {model!r} at {path}: POST /v1/models/{model}/profile first "
                "(or place a `packrat profile` output there)"
            )
        return load_profile(path)

    def plan_for(self, model: str, batch: int, cores: int | None = None) -> Plan:
        """The optimiser's realisable plan for load `batch` from `model`'s profile."""
        ncores = cores or len(self.cores)
        if ncores > len(self.cores):
            raise ConfigError(f"cores {ncores} exceeds the {len(self.cores)} usable cores")
        return realizable_plan(self.profile(model), ncores, batch)

    def explicit_plan(self, model: str, shape: Sequence[tuple[int, int]]) -> Plan:
        """A plan of the given (threads, batch cap) workers, predicted from the profile if it has them."""
        try:
            profile: Profile | None = self.profile(model)
        except ProfileError:
            profile = None  # explicit plans need no profile; they just have no prediction
        return plan_from_shape(shape, len(self.cores), profile)

    def start_profile(self, model: str, *, max_batch: int, budget_s: float | None,
                      cores: int | None = None) -> Job:
        """Re-profile `model`'s base archive in the background; the job says when it is done."""
        st = self.model_state(model)
        base_dir = self.settings.model_store / self.swapper.base_of(st.url)
        settings = ProfileSettings(cores=cores or len(self.cores), max_batch=max_batch, budget_s=budget_s)
        settings.validate(len(self.cores))
        archive = open_archive(base_dir)
        out = self.profile_path(model)

        def run() -> dict[str, Any]:
            prof = run_profile(archive, settings, progress=False)
            save_profile(prof, out)
            return {"profile_path": str(out), "points": len(prof.points)}

        return self.jobs.start("profile", model, run)

    # -- acting -------------------------------------------------------------------
    def swap_busy(self) -> bool:
        return self._swap_lock.locked()

    def apply(self, model: str, plan: Plan) -> SwapRecord:
        """Swap `model` to `plan` (one swap at a time); the attempt is recorded whatever happens."""
        if not self._swap_lock.acquire(blocking=False):
            raise BusyError("a swap is already running; try again when it is done")
        try:
            versions.validate_plan(plan, len(self.cores))
            self.swapper.current(model)  # TorchServeError 404 for an unknown model, before anything
            self.running_swap = SwapRecord(model, None, None, plan, self.clock())
            try:
                record = self.swapper.apply(model, plan)
            except SwapError as exc:
                if exc.record is not None:
                    self._append_history(exc.record.to_dict())
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



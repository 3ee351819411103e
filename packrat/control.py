"""The controller: owns the live plans of one TorchServe, its clock and its state dir.

It attaches to a running TorchServe and never assumes it started it, so it can
be killed and restarted at any time without disturbing serving:

- what is live is read back from TorchServe (default version of each model)
  and from the version directory it was registered from (the plan travels in
  its model_config.yaml);
- what TorchServe does not know lives in the state dir (`.packrat/` by default):
    swaps.jsonl        one line per swap attempt (durations, outcome, error)
    policy-state.json  the re-plan policy's state, per model
    last-plans.json    per model, the version and plan the last successful swap made live
    profiles/<m>/<mode>.json  one profile per execution mode (packrat.profile.library)
    tune/<m>.json      the last tune of each model: stages, modes, refusals, choice
    cores.json         how the usable cores are divided among the models (packrat.plan.share)
    profiles/<m>.json  profiles made through the REST API
    controller.lock    flock: one controller per state dir
- one controller per TorchServe: it also holds an flock on
  `<model store>/.packrat-controller.lock`. Every controller of a TorchServe
  must use that TorchServe's model store (versions are registered by their
  directory name in it), whatever path it is given, and two controllers on one
  store would also number and delete each other's version directories.
  TorchServe skips hidden files when it scans the store.
- on attach it finishes what a killed controller left half done: a Packrat
  version that is loaded but not the default is retired (Swapper.retire:
  drained, scaled to 0, queue confirmed empty, unregistered), and version
  directories no version was registered from are deleted.
- each tick it checks that the version of each model's last successful swap
  is still loaded. When it is not (TorchServe restarted and loaded the base
  model, or someone unregistered it), the last plan is applied again, at most
  once per `reapply_backoff_s`.

Swaps run on their own thread (one at a time; a second gets BusyError): the
tick thread keeps deciding while a swap takes its 10-60 s, and any exception
in a tick is logged, counted (packrat_controller_tick_errors_total in
/metrics) and the loop goes on.

Cores among models. With the re-plan loop on, each tick divides the usable
cores (packrat.cores: affinity ∩ cgroup cpuset, capped by the CPU quota)
among the models with load, minimising the worst model's predicted latency
(packrat.plan.share), with the policy's gain threshold as hysteresis. Each
model is planned for its own cores and its versions pin inside them; a model
whose workers run outside its cores is moved ("cores-moved"), shrinking ones
first. A model idle for `idle_footprint_after_s` moves to one 1-thread worker
on the shared core (the last one).

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
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from packrat.apply import versions
from packrat.apply.client import ManagementClient, scrape_metrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from packrat.apply.swap import Swapper, SwapSettings, WorkerCheck, check_workers
from packrat.errors import BusyError, ConfigError, PackratError, ProfileError, SwapError, TorchServeError
from packrat.jobs import Job, Jobs, Turns
from packrat.observe import metrics
from packrat import tune
from packrat.cores import usable_cores
from packrat.plan import mode_candidates, plan_from_shape, realizable_plan, same_shape
from packrat.plan.share import Demand, Division, divide_cores, keep_or_move
from packrat.profile import ProfileSettings, load_profile, open_archive, run_profile, save_profile
from packrat.profile.fingerprint import mode_from_config
from packrat.profile.identity import archive_in_mode
from packrat.profile.library import profile_file, usable_profiles
from packrat.types import Observation, Plan, Policy, Profile, SwapRecord, TickContext

DEFAULT_STATE_DIR = Path(".packrat")
HISTORY_FILE = "swaps.jsonl"
POLICY_STATE_FILE = "policy-state.json"
LAST_PLANS_FILE = "last-plans.json"
CORES_FILE = "cores.json"
STATE_LOCK_FILE = "controller.lock"
# GET /healthz fails when the tick loop has not gone round for this long (ticks may
# wait on TorchServe's 30 s HTTP timeout; the liveness probe adds its own 2 minutes).
HEALTH_STALE_TICKS = 12
HEALTH_STALE_MIN_S = 60.0
# In the model store: one controller per TorchServe (hidden: TorchServe's store scan skips it).
STORE_LOCK_FILE = ".packrat-controller.lock"

log = logging.getLogger("packrat.controller")


@dataclass(frozen=True)
class ControllerSettings:
    management_url: str
    key_file: Path
    model_store: Path
    metrics_url: str | None = None  # observed latency in status; none when unset
    state_dir: Path = DEFAULT_STATE_DIR
    cores: tuple[int, ...] | None = None  # usable cores; default: this process's affinity
    tick_s: float = 5.0  # how often the tick runs (restart watch, and the policy when one is set)
    # After re-applying a lost plan, wait this long before trying again (a re-apply that
    # keeps failing must not swap every tick).
    reapply_backoff_s: float = 30.0
    swap: SwapSettings = field(default_factory=SwapSettings)
    # Cores among models (packrat.plan.share): per-model weights on predicted latency
    # (default 1), the hysteresis of a re-division, and how long a model must be idle
    # before it moves to the shared core (a swap costs seconds: not for a short pause).
    core_weights: dict[str, float] = field(default_factory=dict)
    division_threshold: float = 0.10
    idle_footprint_after_s: float = 120.0


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
    mode: str | None = None  # execution mode the live version runs; None: not a Packrat archive
    cores: tuple[int, ...] | None = None  # cores the live version's slots pin to; None: not Packrat's


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
    tune: dict[str, Any] | None = None  # the model's last or running tune (packrat.tune.Tracker)
    share: tuple[int, ...] | None = None  # the cores this model may use now (cores among models)


class _Metrics:
    """The controller's own series (beside the re-plan loop's) for GET /metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tick_errors = Counter("packrat_controller_tick_errors",
                                   "Exceptions caught in the controller's tick (logged; the loop goes on)",
                                   registry=registry)
        # packrat_swaps_total and packrat_swap_phase_seconds: names a dashboard relies on.
        self.swaps = Counter("packrat_swaps", "Swaps run by the controller, by outcome",
                             ["model", "outcome"], registry=registry)
        self.swap_phases = Histogram(
            "packrat_swap_phase_seconds",
            "Seconds per swap phase (docs/live-plans.md: the ready phase split into worker_start, "
            "model_load, mode_build, guard, warmup, ready_check)",
            ["model", "phase"], registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120, 300))
        self.swap_running = Gauge("packrat_controller_swap_running", "1 while a swap runs", registry=registry)
        self.lost_versions = Counter(
            "packrat_controller_lost_versions",
            "Times the version of a model's last swap was no longer loaded (TorchServe restarted)",
            ["model"], registry=registry)
        self.reapplies = Counter("packrat_controller_reapplies",
                                 "Last plans applied again after their version was lost", ["model"],
                                 registry=registry)
        self.unreachable = Gauge("packrat_controller_torchserve_unreachable",
                                 "1 while TorchServe's management API does not answer the tick",
                                 registry=registry)
        # Cores among models (packrat.plan.share): how many cores each model may use now.
        self.model_cores = Gauge("packrat_model_cores", "Cores the model may use now (its share, the "
                                 "shared core when idle, else every usable core)", ["model"], registry=registry)
        self.redivisions = Counter("packrat_core_divisions", "Times the division of cores among models "
                                   "changed, by why", ["why"], registry=registry)


class _LivePlans:
    """Collector: the plan each model's last swap made live (last-plans.json), read at
    scrape time, so GET /metrics never calls TorchServe (dashboards: docs/grafana/)."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def describe(self) -> list[Any]:
        return []  # registering must not read the state dir; the names are not checked for clashes

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        info = InfoMetricFamily("packrat_live_plan", "The live version, mode and shape of each model "
                                "(the plan the controller keeps live)", labels=["model"])
        workers = GaugeMetricFamily("packrat_live_plan_workers", "Workers of the live plan", labels=["model"])
        batch = GaugeMetricFamily("packrat_live_plan_batch", "Load batch B the live plan was made for",
                                  labels=["model"])
        predicted = GaugeMetricFamily("packrat_live_plan_predicted_latency_ms",
                                      "Predicted latency of the live plan (absent: not predicted)",
                                      labels=["model"])
        store = self.controller.settings.model_store
        for model, entry in sorted(self.controller._last_plans().items()):
            try:
                plan = Plan.from_dict(entry["plan"])
            except (KeyError, TypeError, ValueError):
                continue
            mode = plan.mode or versions.served_mode(store / str(entry.get("url", ""))) or ""
            counts: dict[tuple[int, int], int] = {}
            for tb in plan.shape:
                counts[tb] = counts.get(tb, 0) + 1
            shape = " + ".join(f"{n}x {t}t/b{b}" for (t, b), n in counts.items())
            info.add_metric([model], {"version": str(entry.get("version")), "mode": mode, "shape": shape})
            workers.add_metric([model], len(plan.instances))
            batch.add_metric([model], plan.batch)
            if plan.predicted_latency_ms:
                predicted.add_metric([model], plan.predicted_latency_ms)
        return [info, workers, batch, predicted]


@dataclass
class SwapTask:
    """A swap handed to the swap thread; `done` is set when it finished either way."""

    model: str
    plan: Plan
    cores: tuple[int, ...]  # where the new version's workers pin
    done: threading.Event = field(default_factory=threading.Event)
    record: SwapRecord | None = None
    error: BaseException | None = None


def _read_state(path: Path) -> dict[str, Any]:
    """A JSON object from the state dir; {} when missing or unreadable (a restart starts afresh)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_state(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename with fsync: a crash leaves the old file or the new one, never half."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _flock(path: Path, busy: str) -> int:
    """Take an exclusive flock on `path` (never through a symlink); ConfigError(busy) if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        try:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        finally:
            os.close(fd)
        raise ConfigError(f"{busy} ({path}: {holder or 'holder unknown'})") from exc
    return fd


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
        if settings.cores is not None:
            self.cores: list[int] = list(settings.cores)
            self.cores_reason = f"given: {len(self.cores)} cores"
        else:
            found = usable_cores()  # affinity ∩ cgroup cpuset, quota cap, $PACKRAT_CORES
            self.cores = list(found.cores)
            self.cores_reason = found.reason
        self.division: Division | None = None
        self.division_why: str | None = None
        self._idle_since: dict[str, float] = {}
        self._batches: dict[str, int | None] = {}
        self.swapper = Swapper(self.client, settings.model_store, self.cores, settings.swap)
        # One swap at a time per controller (REST calls and ticks share it), run on its own thread.
        self._swap_lock = threading.Lock()
        self._lock_fds: list[int] = []
        self._last_observation: dict[str, Observation] = {}
        self.running_swap: SwapRecord | None = None
        self.jobs = Jobs()
        # Profiling and tuning jobs take turns: two runs on the same cores measure each other.
        self.turns = Turns()
        self._tunes: dict[str, Any] = {}  # model -> packrat.tune.Tracker of its latest tune
        self.registry = CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self.registry.register(_LivePlans(self))  # type: ignore[arg-type]
        self.last_tick_at: float | None = None  # time.monotonic() the tick loop last went round
        self._reapply_after: dict[str, float] = {}
        self._unreachable = False

    # -- lifecycle ------------------------------------------------------------
    def acquire(self) -> None:
        """Take the state dir's lock and the model store's: one controller per TorchServe.

        The model store is the TorchServe's own: every controller of it must
        create its version directories there, so its lock is held by exactly the
        controllers that could fight over that TorchServe (see the module docstring).
        """
        fds = [_flock(self.state_dir / STATE_LOCK_FILE, f"another controller uses the state dir {self.state_dir}")]
        try:
            fds.append(_flock(Path(self.settings.model_store) / STORE_LOCK_FILE,
                              "another controller manages the TorchServe of this model store"))
        except BaseException:
            os.close(fds[0])
            raise
        for fd in fds:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} management {self.settings.management_url}\n".encode())
        self._lock_fds = fds

    def release(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []

    def attach(self) -> list[str]:
        """Read what is live and finish half-done swaps; returns what was cleaned up."""
        cleaned: list[str] = []
        last = self._last_plans()
        for m in self.client.list_models():
            name = m["modelName"]
            default_version, default_url = self.swapper.current(name)
            registered_urls = set()
            for d in self.client.describe_all(name):
                registered_urls.add(d["modelUrl"])
                v = d["modelVersion"]
                if v == default_version:
                    continue
                path = self.settings.model_store / d["modelUrl"]
                if (path / versions.MANIFEST).exists() and versions.load_version(path) is not None:
                    # Left over by a killed swap: new-but-not-default, or old-not-yet-retired
                    # (possibly already scaled to 0 with jobs back in its queue: retire serves them).
                    try:
                        self.swapper.retire(name, v)
                    except (SwapError, TorchServeError) as exc:
                        log.warning("could not retire %s %s left by a killed swap: %s", name, v, exc)
                        continue  # still registered: its directory stays
                    self.swapper.retire_dir(d["modelUrl"])
                    registered_urls.discard(d["modelUrl"])
                    cleaned.append(f"{name} {v}")
            # Version dirs of this model that nothing is registered from: a swap died before register.
            for path in self.settings.model_store.glob(f"{name}.p*"):
                if path.name not in registered_urls and (path / versions.MANIFEST).exists():
                    if versions.load_version(path) is not None:
                        versions.remove_version(path)
                        cleaned.append(str(path.name))
            # What is live and Packrat's is the plan to keep live (a newer controller's view wins).
            live = self.settings.model_store / default_url
            vdir = versions.load_version(live) if (live / versions.MANIFEST).exists() else None
            if vdir is not None:
                last[name] = {"version": default_version, "url": default_url, "plan": vdir.plan.to_dict()}
        _write_state(self.state_dir / LAST_PLANS_FILE, last)
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
            mode=versions.served_mode(path),
            cores=tuple(sorted({c for sl in vdir.slots for c in sl.cores})) if vdir else None,
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
            tune=self.tune_status(model),
            share=self.share_of(model),
        )

    # -- plans and profiles ---------------------------------------------------------
    def profile_path(self, model: str) -> Path:
        return self.state_dir / "profiles" / f"{model}.json"

    def profile(self, model: str) -> Profile:
        """The profile the controller plans `model` from; ProfileError when there is none.

        The per-mode profile of the live mode when it is still valid for the base
        archive and this machine (packrat.profile.library), else a profile placed
        at profile_path(model)."""
        live = self._live_mode_profile(model)
        if live is not None:
            return live
        path = self.profile_path(model)
        if not path.exists():
            raise ProfileError(
                f"no profile for {model!r} at {path}: POST /v1/models/{model}/profile first "
                "(or place a `packrat profile` output there)"
            )
        return load_profile(path)

    def _live_mode_profile(self, model: str) -> Profile | None:
        st = self.model_state(model)
        if st.mode is None:
            return None
        base_dir = self.settings.model_store / self.swapper.base_of(st.url)
        for prof in usable_profiles(self.state_dir, model, base_dir):
            if prof.fingerprint is not None and prof.fingerprint.mode == st.mode:
                return prof
        return None

    def _live_mode_override(self, model: str) -> str | None:
        """The live mode when it is not the base archive's own (a plan must keep it), else None."""
        st = self.model_state(model)
        base_mode = versions.served_mode(self.settings.model_store / self.swapper.base_of(st.url))
        return st.mode if st.mode is not None and st.mode != base_mode else None

    def plan_for(self, model: str, batch: int, cores: int | None = None) -> Plan:
        """The optimiser's realisable plan for load `batch` from `model`'s profile (in its mode)."""
        ncores = cores or len(self.cores)
        if ncores > len(self.cores):
            raise ConfigError(f"cores {ncores} exceeds the {len(self.cores)} usable cores")
        profile = self.profile(model)
        plan = realizable_plan(profile, ncores, batch)
        mode = profile.fingerprint.mode if profile.fingerprint is not None else None
        return replace(plan, mode=mode or self._live_mode_override(model))

    def explicit_plan(self, model: str, shape: Sequence[tuple[int, int]]) -> Plan:
        """A plan of the given (threads, batch cap) workers in the live mode, predicted from
        the profile if it has them."""
        try:
            profile: Profile | None = self.profile(model)
        except ProfileError:
            profile = None  # explicit plans need no profile; they just have no prediction
        return replace(plan_from_shape(shape, len(self.cores), profile), mode=self._live_mode_override(model))

    def start_profile(self, model: str, *, max_batch: int, budget_s: float | None,
                      cores: int | None = None) -> Job:
        """Re-profile `model` in its live mode in the background; the job says when it is done.

        The profile goes where tuning and the re-plan loop read it:
        <state dir>/profiles/<model>/<mode>.json (packrat.profile.library)."""
        st = self.model_state(model)
        base_dir = self.settings.model_store / self.swapper.base_of(st.url)
        settings = ProfileSettings(cores=cores or len(self.cores), max_batch=max_batch, budget_s=budget_s)
        settings.validate(len(self.cores))
        archive = open_archive(base_dir)
        if st.mode is not None:
            archive = archive_in_mode(archive, st.mode)
        out = profile_file(self.state_dir, model, mode_from_config(archive.config))

        def run() -> dict[str, Any]:
            prof = run_profile(archive, settings, progress=False)
            save_profile(prof, out)
            return {"profile_path": str(out), "points": len(prof.points)}

        return self.jobs.start("profile", model, run, turns=self.turns)

    # -- tuning (packrat.tune: modes x shapes, docs/tuning.md) -------------------------
    def base_of(self, model: str, st: ModelState | None = None) -> tuple[str, Path]:
        """(name, path) of the base archive behind `model`'s live version."""
        st = st or self.model_state(model)
        base = self.swapper.base_of(st.url)
        return base, self.settings.model_store / base

    def tick_profiles(self, model: str, st: ModelState | None = None) -> tuple[Profile, ...]:
        """The per-mode profiles of `model` usable now (archive hash and fingerprint checked)."""
        st = st or self.model_state(model)
        if st.mode is None:
            return ()
        _, base_dir = self.base_of(model, st)
        try:
            return usable_profiles(self.state_dir, model, base_dir)
        except (OSError, PackratError) as exc:
            log.warning("%s: per-mode profiles unusable: %s", model, exc)
            return ()

    def tune_key(self, model: str, st: ModelState | None = None) -> dict[str, Any] | None:
        """What a tune of `model` is valid for (base archive, its hash, this machine);
        None when the live version is not a Packrat archive (nothing to tune)."""
        st = st or self.model_state(model)
        if st.mode is None:
            return None
        base, base_dir = self.base_of(model, st)
        if not (base_dir / "packrat_handler.py").is_file():
            return None  # a model served by its own handler: no modes to try
        return tune.tune_key(base_dir, base)

    def tune_status(self, model: str) -> dict[str, Any] | None:
        """The running or last tune of `model` (stage, modes, choice), or None if never tuned."""
        tracker = self._tunes.get(model)
        return tracker.snapshot() if tracker is not None else tune.load_record(self.state_dir, model)

    def observed_batch(self, model: str) -> int | None:
        """The re-plan loop's latest ready estimate of B under load, if any."""
        if self.policy is None:
            return None
        for d in reversed(self.policy.decisions(model, last=10)):
            est = d.get("estimate") or {}
            if est.get("ready") and not est.get("idle") and d.get("estimated_batch"):
                return int(d["estimated_batch"])
        return None

    def start_tune(self, model: str, *, modes: Sequence[str] | None = None, budget_s: float | None = None,
                   batch: int | None = None, fresh: bool = False, max_batch: int | None = None,
                   point_budget_s: float | None = None, trigger: str = "request") -> Job:
        """Tune `model` in the background: guard and profile each candidate mode, choose
        (mode, plan) for `batch` (default: the observed B, else tune.DEFAULT_BATCH) and
        apply it by the usual swap. Tunes and profiling jobs take turns (queued).
        BusyError while a tune of this model is queued or running."""
        st = self.model_state(model)  # TorchServeError 404 for an unknown model
        base, base_dir = self.base_of(model, st)
        if st.mode is None or not (base_dir / "packrat_handler.py").is_file():
            raise ConfigError(f"{model}: its live version is not a Packrat archive (no packrat_handler.py "
                              "or packrat.task); nothing to tune")
        if self.jobs.unfinished("tune", model) is not None:
            raise BusyError(f"a tune of {model} is already queued or running")
        settings = tune.TuneSettings(
            cores=len(self.cores), batch=batch or self.observed_batch(model) or tune.DEFAULT_BATCH,
            modes=tune.requested_modes(modes), budget_s=budget_s or tune.DEFAULT_BUDGET_S, fresh=fresh,
            max_batch=max_batch, point_budget_s=point_budget_s or tune.DEFAULT_POINT_BUDGET_S)
        settings.validate(len(self.cores))
        previous = tune.load_record(self.state_dir, model)
        job_ref: dict[str, Job] = {}

        def publish(snap: dict[str, Any]) -> None:
            job = job_ref.get("job")
            if job is not None:
                job.progress = snap

        tracker = tune.Tracker(self.state_dir, model, on_change=publish)
        tracker.set(trigger=trigger, batch=settings.batch, budget_s=settings.budget_s)
        self._tunes[model] = tracker

        def work(job: Job) -> dict[str, Any]:
            job_ref["job"] = job
            key: dict[str, Any] | None = None
            try:
                key = tune.tune_key(base_dir, base)
                result = tune.tune_model(base_dir, model, self.state_dir, settings, tracker, previous=previous)
                return self._apply_tuned(model, result, tracker, key)
            except Exception as exc:
                tracker.set(state="failed", stage="failed", text=f"failed: {exc}"[:500], error=str(exc),
                            finished=self.clock(), key=key)
                raise

        job = self.jobs.start("tune", model, work, per_model=True, turns=self.turns, with_job=True)
        job.progress = tracker.snapshot()
        return job

    def _apply_tuned(self, model: str, result: Any, tracker: Any, key: dict[str, Any]) -> dict[str, Any]:
        plan: Plan = result.plan
        base_row = result.per_mode[0] if result.per_mode else {}  # the archive's own mode comes first
        summary = (f"{tune.describe(plan)}: predicted {plan.predicted_latency_ms:.0f} ms at B={plan.batch}"
                   + (f" (fat {base_row['mode']}: {base_row['fat_ms']:.0f} ms)"
                      if base_row.get("fat_ms") else ""))
        tracker.set(stage="applying", text=f"applying {summary}", choice=plan.to_dict())
        live = self.model_state(model)
        live_plan = replace(live.plan, mode=live.plan.mode or live.mode) if live.plan is not None else None
        swap: dict[str, Any] | None
        if live_plan is not None and same_shape(live_plan, plan) and live_plan.mode == plan.mode:
            swap = {"outcome": "already live", "version": live.version}
        else:
            deadline = time.monotonic() + self.settings.swap.ready_timeout_s
            while True:  # another swap (the re-plan loop's, a REST apply) may be running
                try:
                    swap = self.apply(model, plan).to_dict()
                    break
                except BusyError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)
        tracker.set(state="done", stage="applied", text=f"applied {summary}", swap=swap,
                    finished=self.clock(), key=key)
        return tracker.snapshot()

    # -- acting -------------------------------------------------------------------
    def start_swap(self, model: str, plan: Plan) -> SwapTask:
        """Start swapping `model` to `plan` on the swap thread and return at once.

        The new version pins inside the model's cores (share_of) when the plan fits
        there, else on all usable cores (an explicit plan wider than the share; the
        re-plan loop moves it back when the model has load).
        BusyError while another swap runs; ConfigError / TorchServeError (unknown
        model) before anything is touched. The attempt is recorded whatever happens.
        """
        if not self._swap_lock.acquire(blocking=False):
            raise BusyError("a swap is already running; try again when it is done")
        return self._start_swap_locked(model, plan)

    def swap_cores(self, model: str, plan: Plan) -> tuple[int, ...]:
        """The cores a new version of `model` running `plan` pins to."""
        share = self.share_of(model)
        return share if plan.threads_used <= len(share) else tuple(self.cores)

    def _start_swap_locked(self, model: str, plan: Plan) -> SwapTask:
        """start_swap() for a caller that holds the swap lock; the swap thread releases it."""
        try:
            versions.validate_plan(plan, len(self.cores))
            self.swapper.current(model)  # TorchServeError 404 for an unknown model, before anything
            task = SwapTask(model, plan, self.swap_cores(model, plan))
            self.running_swap = SwapRecord(model, None, None, plan, self.clock(), phase="starting")
            self.metrics.swap_running.set(1)
            threading.Thread(target=self._run_swap, args=(task,), name=f"packrat-swap-{model}",
                             daemon=True).start()
        except BaseException:
            self.running_swap = None
            self.metrics.swap_running.set(0)
            self._swap_lock.release()
            raise
        return task

    def apply(self, model: str, plan: Plan) -> SwapRecord:
        """Swap `model` to `plan` and wait for the result (the swap runs on the swap thread)."""
        task = self.start_swap(model, plan)
        task.done.wait()
        if task.error is not None:
            raise task.error
        assert task.record is not None
        return task.record

    def _run_swap(self, task: SwapTask) -> None:
        try:
            record = self.swapper.apply(task.model, task.plan, on_phase=self._on_phase, cores=task.cores)
            task.record = record
            self.metrics.swaps.labels(task.model, record.outcome).inc()
            self._observe_phases(record)
            self._record_quietly(record.to_dict())
            try:
                self._remember(record)  # before the lock is released: the restart watch reads it
            except OSError:
                log.exception("could not save %s", self.state_dir / LAST_PLANS_FILE)
        except SwapError as exc:
            task.error = exc
            outcome = exc.record.outcome if exc.record is not None else "failed"
            self.metrics.swaps.labels(task.model, outcome).inc()
            if exc.record is not None:
                self._observe_phases(exc.record)
                self._record_quietly(exc.record.to_dict())
        except BaseException as exc:  # reported to the caller; the swap thread must not die silently
            task.error = exc
            self.metrics.swaps.labels(task.model, "error").inc()
            log.exception("swap of %s failed", task.model)
        finally:
            self.running_swap = None
            self.metrics.swap_running.set(0)
            self._swap_lock.release()
            task.done.set()

    def _observe_phases(self, record: SwapRecord) -> None:
        """Every phase of the record, "ready" replaced by its breakdown when the workers gave one."""
        breakdown = dict(record.ready_phases_s)
        for name, seconds in record.phases_s:
            for leaf, s in (breakdown.items() if name == "ready" and breakdown else [(name, seconds)]):
                self.metrics.swap_phases.labels(record.model, leaf).observe(s)

    def _on_phase(self, record: SwapRecord) -> None:
        self.running_swap = record

    def _record_quietly(self, rec: dict[str, Any]) -> None:
        try:
            self._append_history(rec)
        except OSError:
            log.exception("could not append to %s", self.state_dir / HISTORY_FILE)

    def _append_history(self, rec: dict[str, Any]) -> None:
        # Append + fsync per line: a crash loses at most the line being written.
        with open(self.state_dir / HISTORY_FILE, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # -- the last applied plan, and TorchServe restarts -------------------------------
    def _last_plans(self) -> dict[str, dict[str, Any]]:
        return _read_state(self.state_dir / LAST_PLANS_FILE)

    def _remember(self, record: SwapRecord) -> None:
        plans = self._last_plans()
        plans[record.model] = {"version": record.to_version, "url": f"{record.model}.{record.to_version}",
                               "plan": record.plan.to_dict()}
        _write_state(self.state_dir / LAST_PLANS_FILE, plans)

    def watch(self, models: Sequence[str]) -> list[str]:
        """Apply the last plan again where its version is no longer loaded; returns those models.

        The version a successful swap made live stays loaded until the next swap
        replaces it. If TorchServe no longer lists it, TorchServe restarted (and
        loaded the base model, or nothing) or someone unregistered it: the plan
        the controller last made live is made live again.
        """
        # Looked for without the swap lock: holding it for every tick's describe calls
        # would refuse an apply arriving meanwhile (BusyError) for no swap at all.
        if not any(self._lost(model, entry) for model, entry in self._last_plans().items() if model in models):
            return []
        # Acted on under the swap lock, checked again: a swap changes versions on purpose,
        # and one that ends between reading last-plans.json and acting must not be undone.
        if not self._swap_lock.acquire(blocking=False):
            return []
        handed_over = False
        try:
            for model, entry in self._last_plans().items():
                if model not in models or not self._lost(model, entry):
                    continue
                self._reapply_after[model] = self.clock() + self.settings.reapply_backoff_s
                self.metrics.lost_versions.labels(model).inc()
                log.warning("%s: version %s of the last swap is no longer loaded (TorchServe restarted?); "
                            "applying its plan again", model, entry.get("version"))
                # Its directory outlived it (TorchServe stopped before a swap could retire it).
                self.swapper.retire_dir(str(entry.get("url")))
                plan = Plan.from_dict(entry["plan"])
                handed_over = True  # _start_swap_locked releases the lock, also when it fails
                self._start_swap_locked(model, plan)
                self.metrics.reapplies.labels(model).inc()
                return [model]  # one swap at a time
            return []
        finally:
            if not handed_over:
                self._swap_lock.release()

    def _lost(self, model: str, entry: dict[str, Any]) -> bool:
        """The version of `model`'s last swap is not loaded, and its re-apply is not backing off."""
        if self.clock() < self._reapply_after.get(model, 0.0):
            return False
        try:
            loaded = {d["modelVersion"] for d in self.client.describe_all(model)}
        except TorchServeError:
            return False
        return entry.get("version") not in loaded

    def metrics_text(self) -> bytes:
        """The controller's series and the re-plan loop's, in Prometheus text format."""
        out = generate_latest(self.registry)
        if self.policy is not None:
            out += self.policy.metrics_text()
        return out

    # -- cores among models (packrat.plan.share) ---------------------------------------
    def share_of(self, model: str) -> tuple[int, ...]:
        """The cores `model` may use now: its share, the shared core when idle, else all."""
        d = self.division
        return d.cores_of(model) if d is not None else tuple(self.cores)

    def cores_status(self) -> dict[str, Any]:
        """What was found (usable cores and why) and how they are divided now."""
        return {"usable": list(self.cores), "reason": self.cores_reason,
                "division": self.division.to_dict() if self.division is not None else None,
                "why": self.division_why}

    def _load_batch(self, model: str) -> int | None:
        """The estimated B of `model`'s load from the re-plan loop's latest decision;
        None when idle. While the estimate warms up, the last known value holds."""
        assert self.policy is not None
        decisions = self.policy.decisions(model, last=1)
        est = (decisions[-1].get("estimate") or {}) if decisions else {}
        if est.get("ready"):
            self._batches[model] = None if est.get("idle") else int(decisions[-1]["estimated_batch"])
        return self._batches.get(model)

    def _predictor(self, model: str, profiles: tuple[Profile, ...],
                   batch: int) -> Callable[[int], float | None] | None:
        """Predicted latency of `model`'s best plan for `batch` on c cores, or None (no profile)."""
        if profiles:
            def across_modes(c: int) -> float | None:
                try:
                    cands, _, _ = mode_candidates(profiles, c, batch, None)
                except PackratError:
                    return None
                return cands[0].predicted_latency_ms if cands else None
            return across_modes
        path = self.profile_path(model)
        if not path.exists():
            return None
        try:
            profile = load_profile(path)
        except PackratError:
            return None
        most = max(p.batch for p in profile.points)

        def one_profile(c: int) -> float | None:
            try:
                return realizable_plan(profile, c, min(batch, c * most)).predicted_latency_ms
            except PackratError:
                return None
        return one_profile

    def divide(self, states: dict[str, ModelState], profiles: dict[str, tuple[Profile, ...]]) -> Division:
        """Divide the usable cores among the models by their load (kept unless the
        re-division is predicted `division_threshold` better); saved to cores.json.
        `profiles`: each model's checked per-mode profiles this tick (tick_profiles)."""
        demands = []
        for model, st in states.items():
            batch = self._load_batch(model)
            predict = (self._predictor(model, profiles.get(model, ()), batch)
                       if batch is not None and st.plan is not None else None)
            demands.append(Demand(model, batch, predict, self.settings.core_weights.get(model, 1.0)))
        previous = self.division
        if previous is None:
            saved = _read_state(self.state_dir / CORES_FILE).get("division")
            try:
                previous = Division.from_dict(saved) if saved else None
            except (KeyError, TypeError, ValueError):
                previous = None
        proposed = divide_cores(demands, self.cores)
        division, why = keep_or_move(previous, proposed, demands, self.settings.division_threshold)
        if previous is None or division.shares != previous.shares or division.rule != previous.rule:
            log.info("cores divided (%s, %s): %s; idle on %s: %s", division.rule, why,
                     {m: list(c) for m, c in division.shares.items()}, list(division.shared),
                     list(division.idle))
        if previous is not None and (division.shares != previous.shares or division.rule != previous.rule):
            self.metrics.redivisions.labels(why).inc()
        for model in states:
            self.metrics.model_cores.labels(model).set(len(division.cores_of(model)))
        if division != self.division:
            _write_state(self.state_dir / CORES_FILE, {"division": division.to_dict(), "why": why,
                                                       "reason": self.cores_reason})
        self.division, self.division_why = division, why
        return division

    def _footprint(self, states: dict[str, ModelState]) -> list[str]:
        """Move one model idle for idle_footprint_after_s onto the shared core (1 worker,
        1 thread), while other models have load; returns the model moved, if any."""
        d = self.division
        now = self.clock()
        if d is None or d.rule != "split":
            self._idle_since.clear()
            return []
        for model in list(self._idle_since):
            if model not in d.idle:
                del self._idle_since[model]
        for model in d.idle:
            since = self._idle_since.setdefault(model, now)
            st = states.get(model)
            if st is None or st.plan is None or st.cores is None or set(st.cores) <= set(d.shared):
                continue
            if now - since < self.settings.idle_footprint_after_s:
                continue
            cap = max(i.batch for i in st.plan.instances)
            plan = replace(plan_from_shape([(1, cap)], len(d.shared), None),
                           mode=st.plan.mode or self._live_mode_override(model))
            try:
                self.start_swap(model, plan)
            except BusyError:
                return []
            log.info("%s: idle for %.0f s; moved to the shared core %s", model, now - since, list(d.shared))
            return [model]
        return []

    # -- the policy seam -------------------------------------------------------------
    def policy_state(self) -> dict[str, Any]:
        return _read_state(self.state_dir / POLICY_STATE_FILE)

    def _save_policy_state(self, state: dict[str, Any]) -> None:
        _write_state(self.state_dir / POLICY_STATE_FILE, state)

    def tick(self) -> list[str]:
        """One round: the restart watch, then the policy over every model.

        Swaps start on the swap thread (this returns at once); returns the models
        a swap was started for. An exception for one model is logged and counted,
        and the other models still get their turn.
        """
        try:
            models = self.models()
        except TorchServeError as exc:
            if not self._unreachable:
                log.warning("TorchServe's management API does not answer: %s", exc)
            self._unreachable = True
            self.metrics.unreachable.set(1)
            return []
        if self._unreachable:
            log.warning("TorchServe's management API answers again")
            self._unreachable = False
            self.metrics.unreachable.set(0)
        started = self._guarded("watch", lambda: self.watch(models)) or []
        if self.policy is None:
            return started
        states: dict[str, ModelState] = {}
        for model in models:
            st = self._guarded(model, lambda: self.model_state(model))
            if st is not None:
                states[model] = st
        # Each model's per-mode profiles, read and checked once for the division and its tick.
        profiles = {m: self._guarded(m, lambda: self.tick_profiles(m, st)) or () for m, st in states.items()}
        self._guarded("divide", lambda: self.divide(states, profiles))
        all_state = self.policy_state()
        # Models that must give cores back move first: no core carries two models'
        # versions beyond what one swap needs.
        order = sorted(states, key=lambda m: not self._misplaced(states[m]))
        for model in order:
            if self._guarded(model, lambda: self._tick_model(model, all_state, states[model], profiles[model])):
                started.append(model)
        started += self._guarded("footprint", lambda: self._footprint(states)) or []
        return started

    def _misplaced(self, st: ModelState) -> bool:
        """The live version's workers run on cores outside the model's share."""
        return st.cores is not None and not set(st.cores) <= set(self.share_of(st.model))

    def _tick_model(self, model: str, all_state: dict[str, Any], st: ModelState,
                    profiles: tuple[Profile, ...]) -> bool:
        assert self.policy is not None
        profile = self.profile_path(model)
        plan = st.plan
        if profiles and plan is not None and plan.mode is None:
            plan = replace(plan, mode=st.mode)  # compared across modes: name the live one
        ctx = TickContext(
            now=self.clock(),
            model=model,
            version=st.version,
            plan=plan,
            observation=self.observe(model),
            cores=len(self.share_of(model)),
            profile_path=profile if profile.exists() else None,
            swap_in_progress=self.running_swap is not None,
            profiles=profiles,
            misplaced=self._misplaced(st) and model in (self.division.shares if self.division else {}),
        )
        new_plan, all_state[model] = self.policy(ctx, all_state.get(model, {}))
        self._save_policy_state(all_state)
        if new_plan is None:
            return False
        try:
            self.start_swap(model, new_plan)
        except BusyError:
            return False  # the next tick decides again
        return True

    def _guarded(self, where: str, fn: Callable[[], Any]) -> Any:
        """Run one part of a tick; an exception is logged and counted, never raised."""
        try:
            return fn()
        except Exception:
            self.metrics.tick_errors.inc()
            log.exception("controller tick failed (%s); continuing", where)
            return None

    def run(self, stop: threading.Event) -> None:
        """Tick until `stop` is set (the REST server runs beside it in another thread).

        Nothing a tick raises ends the loop: it is logged and counted in
        packrat_controller_tick_errors_total.
        """
        self.last_tick_at = time.monotonic()
        while not stop.wait(self.settings.tick_s):
            self._guarded("tick", self.tick)
            self.last_tick_at = time.monotonic()  # GET /healthz: the loop is alive

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, body) for GET /healthz: from what the tick loop last saw, without
        calling TorchServe (the kubelet probes often and must get an answer at once)."""
        stale_after = max(HEALTH_STALE_MIN_S, HEALTH_STALE_TICKS * self.settings.tick_s)
        age = None if self.last_tick_at is None else round(time.monotonic() - self.last_tick_at, 3)
        problems = []
        if age is None:
            problems.append("the tick loop is not running")
        elif age > stale_after:
            problems.append(f"the tick loop has not gone round for {age:.0f} s (limit {stale_after:.0f} s): "
                            "its thread is dead or stuck")
        if self._unreachable:
            problems.append("TorchServe's management API did not answer the last tick")
        return not problems, {"status": "ok" if not problems else "unhealthy", "problems": problems,
                              "tick_age_s": age, "tick_stale_after_s": stale_after,
                              "torchserve_reachable": not self._unreachable,
                              "swap_running": self.running_swap is not None}

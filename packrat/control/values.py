"""The controller's typed values: its settings, and what it answers about a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packrat.apply.client import WorkerDescription
from packrat.apply.swap import SwapSettings, WorkerCheck
from packrat.types import Plan, SwapRecord

DEFAULT_STATE_DIR = Path(".packrat")


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
    # A model quiet this long (no request finished, none pending: Estimate.quiet_s), or
    # longer where its own gaps between requests are longer, counts as idle for the
    # division, so cores are split only between loads that overlap in time (docs/adaptation.md).
    # 1.5 s: two quiet 1 s ticks (quiet_s reads 1, then 2), whatever the ticks' jitter.
    concurrent_quiet_s: float = 1.5


@dataclass(frozen=True)
class WorkerState:
    """One worker as TorchServe describes it, and whether it runs as its slot says."""

    described: dict[str, Any]  # TorchServe's own fields (id, pid, status, memoryUsage, ...)
    check: WorkerCheck | None  # None: a version Packrat did not create (no slots to check)

    @classmethod
    def of(cls, worker: WorkerDescription, check: WorkerCheck | None) -> WorkerState:
        return cls(dict(worker.raw), check)


@dataclass(frozen=True)
class ModelState:
    """One reading of a model's live version: taken once per request or tick and passed down."""

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
    pin: dict[str, Any] | None = None  # the operator's pin (packrat.control.pins), None: not pinned
    traffic: dict[str, Any] | None = None  # sizes served, per kind (packrat.control.traffic.shape)
    # The last swap's version and plan when TorchServe no longer loads it (Swaps.lost_plan).
    lost_plan: dict[str, Any] | None = None

"""Frozen value types that cross stage boundaries (profile -> plan -> apply -> observe -> control).

No loose dicts between stages: a profile, a plan, a swap record, an
observation and what a re-plan policy sees at a tick are these. A plan has one
wire format, `Plan.to_dict()` / `Plan.from_dict()`, used by the CLI, the REST
API, version directories, decision lines and the bench; profiles have theirs
in packrat.profile.store.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol



@dataclass(frozen=True)
class Fingerprint:
    """What a profile's numbers depend on besides the model itself."""

    cpu_model: str
    usable_cores: int
    allocator: str  # e.g. "glibc", "glibc-tuned", "jemalloc"
    torch_version: str
    mode: str  # execution mode, e.g. "fp32-eager", "fp32-torchscript"


@dataclass(frozen=True)
class ProfilePoint:
    """Latency of one instance with `threads` intra-op threads at batch `batch`, measured
    alone (`instances` 1) or as the slowest of `instances` alike instances running at once
    on their own pinned cores (a co-run figure)."""

    threads: int
    batch: int
    mean_ms: float
    p50_ms: float | None = None
    p99_ms: float | None = None
    std_ms: float | None = None
    count: int | None = None
    instances: int = 1
    # How the point was measured (pinned cores seen by the worker, converged, ...);
    # informational only, so it takes no part in equality.
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Profile:
    """A single-instance latency table L(t, b) and where it was measured.

    `model_id` is the archive content hash (or a free-form name for external
    profiles such as the paper's CSVs); `scope` says what was timed:
    "handler" (pre-processing + model + post-processing) or "model" (forward only).
    """

    model_id: str
    points: tuple[ProfilePoint, ...]
    fingerprint: Fingerprint | None = None
    scope: str = "handler"
    # Co-run figures (ProfilePoint.instances >= 2): uniform shapes <i, t> timed with all i
    # instances running at once (packrat.profile.runner). Empty: an isolated-only profile.
    corun: tuple[ProfilePoint, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def latency(self, threads: int, batch: int) -> float | None:
        """The isolated figure L(t, b): one instance alone."""
        for p in self.points:
            if p.threads == threads and p.batch == batch:
                return p.mean_ms
        return None

    @property
    def figures(self) -> str:
        """What the figures mean: "isolated" or "isolated+co-run"."""
        return "isolated+co-run" if self.corun else "isolated"

    def corun_factor(self, instances: int) -> float | None:
        """Co-run over isolated latency for `instances` instances at once: the median
        ratio over the co-run points measured with the most instances <= `instances`
        (None: nothing measured that applies)."""
        counts = sorted({p.instances for p in self.corun if 2 <= p.instances <= instances})
        if not counts:
            return None
        ratios = sorted(p.mean_ms / iso for p in self.corun if p.instances == counts[-1]
                        for iso in [self.latency(p.threads, p.batch)] if iso)
        return ratios[len(ratios) // 2] if ratios else None

    def instance_latency(self, threads: int, batch: int, instances: int = 1) -> float | None:
        """Latency of one of `instances` instances of (threads, batch) running at once.

        One instance: the isolated figure. More: the co-run figure when that shape
        was measured, else the isolated figure times corun_factor (the documented
        approximation for shapes that were not co-run, mixed plans included), else
        the isolated figure (an isolated-only profile).
        """
        found = self.instance_point(threads, batch, instances)
        return None if found is None else found[0].mean_ms * found[1]

    def instance_point(self, threads: int, batch: int, instances: int = 1) -> tuple[ProfilePoint, float] | None:
        """The point instance_latency reads and the factor it scales it by (1.0 unless an
        isolated point stands in for a shape that was not co-run); None: not profiled."""
        if instances > 1:
            for p in self.corun:
                if p.instances == instances and p.threads == threads and p.batch == batch:
                    return p, 1.0
        for p in self.points:
            if p.threads == threads and p.batch == batch:
                factor = self.corun_factor(instances) if instances > 1 else None
                return p, (factor if factor is not None else 1.0)
        return None


@dataclass(frozen=True)
class Instance:
    """One thin worker: `threads` cores/intra-op threads, batches of up to `batch`."""

    threads: int
    batch: int
    latency_ms: float


@dataclass(frozen=True)
class Plan:
    """A multiset of instances for `cores` cores and load batch `batch`.

    Instances are sorted by (threads, batch) descending.
    """

    cores: int
    batch: int
    instances: tuple[Instance, ...]
    predicted_latency_ms: float
    fat_latency_ms: float | None = None
    # Execution mode "<precision>-<runtime>" the workers run (docs/modes.md);
    # None: whatever the base archive's model_config.yaml says.
    mode: str | None = None

    @property
    def expected_speedup(self) -> float | None:
        if self.fat_latency_ms is None or self.predicted_latency_ms <= 0:
            return None
        return self.fat_latency_ms / self.predicted_latency_ms

    @property
    def realizable(self) -> bool:
        """TorchServe can run it as one version: one batch cap shared by all workers."""
        return len({i.batch for i in self.instances}) <= 1

    @property
    def threads_used(self) -> int:
        return sum(i.threads for i in self.instances)

    @property
    def shape(self) -> tuple[tuple[int, int], ...]:
        """The workers as (threads, batch cap), widest first: what two plans share when
        they run alike, whatever batch each was made for."""
        return tuple(sorted(((i.threads, i.batch) for i in self.instances), reverse=True))

    def to_dict(self) -> dict[str, Any]:
        """The plan's one wire format; the derived keys are for readers and ignored on read.
        `mode` is written only when the plan sets one (older readers see the same keys)."""
        out: dict[str, Any] = {
            "cores": self.cores,
            "batch": self.batch,
            "predicted_latency_ms": self.predicted_latency_ms,
            "fat_latency_ms": self.fat_latency_ms,
            "expected_speedup": self.expected_speedup,
            "realizable": self.realizable,
            "threads_used": self.threads_used,
            "instances": [
                {"threads": i.threads, "batch": i.batch, "latency_ms": i.latency_ms}
                for i in sorted(self.instances, key=lambda i: (i.threads, i.batch), reverse=True)
            ],
        }
        if self.mode is not None:
            out["mode"] = self.mode
        return out

    @classmethod
    def from_dict(cls, d: Any) -> Plan:
        """Read `to_dict()`'s output back; ValueError names what is malformed."""
        try:
            return cls(
                cores=int(d["cores"]),
                batch=int(d["batch"]),
                instances=tuple(
                    Instance(int(i["threads"]), int(i["batch"]), float(i.get("latency_ms") or 0.0))
                    for i in d["instances"]
                ),
                # 0: not predicted (an explicit plan applied without a profile)
                predicted_latency_ms=float(d.get("predicted_latency_ms") or 0.0),
                fat_latency_ms=None if d.get("fat_latency_ms") is None else float(d["fat_latency_ms"]),
                mode=None if d.get("mode") is None else str(d["mode"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed plan record: {d!r}") from exc


@dataclass(frozen=True)
class SwapRecord:
    """One swap attempt as the controller's history keeps it (apply -> control -> API)."""

    model: str
    from_version: str | None
    to_version: str | None
    plan: Plan
    started_at: float
    outcome: str = "running"  # running | applied | rolled_back | failed
    duration_s: float | None = None
    phases_s: tuple[tuple[str, float], ...] = ()  # (phase, seconds) in the order they ran
    error: str | None = None
    warnings: tuple[str, ...] = ()
    phase: str | None = None  # while running: the phase under way (packrat.apply.swap.Swapper.apply)
    # Where the "ready" phase went, along its critical path (the new worker that
    # finished loading last): worker_start, model_load, mode_build, guard, warmup,
    # ready_check, from the workers' own status files (docs/live-plans.md).
    ready_phases_s: tuple[tuple[str, float], ...] = ()
    # Per new worker: pid, slot, process_start_s, its start-up phases, build-cache hits.
    workers: tuple[dict[str, Any], ...] = ()
    live_s: float | None = None  # from the apply call until set-default made the new version live

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["plan"] = self.plan.to_dict()
        out["phases_s"] = dict(self.phases_s)
        out["ready_phases_s"] = dict(self.ready_phases_s)
        out["workers"] = [dict(w) for w in self.workers]
        out["warnings"] = list(self.warnings)
        return out


@dataclass(frozen=True)
class Observation:
    """One reading of the live load on a model, taken from TorchServe's own signals."""

    time_s: float
    model: str
    requests_total: float
    latency_us_total: float
    queue_latency_us_total: float | None = None
    pending_requests: int | None = None


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
    # Per-mode profiles whose archive hash and fingerprint were checked this tick
    # (packrat.profile.library); when given, `plan` carries its live mode and the
    # policy chooses across (mode, shape). Empty: plan from `profile_path` alone.
    profiles: tuple[Profile, ...] = ()
    # The live version's workers run on cores outside the `cores` this model has now
    # (packrat.plan.share divided the usable cores among models): the policy must move it.
    misplaced: bool = False


class Policy(Protocol):
    """The controller's re-plan policy (packrat.observe.loop.AdaptiveLoop is the one there is).

    Called once per model per tick with the context and the state it returned
    last time; returns the plan to apply (or None) and the new state, which the
    controller persists. The other methods serve the REST API.
    """

    def __call__(self, ctx: TickContext, state: dict[str, Any]) -> tuple[Plan | None, dict[str, Any]]: ...

    def status(self, model: str) -> dict[str, Any]: ...

    def is_enabled(self, model: str) -> bool: ...

    def set_enabled(self, model: str, enabled: bool) -> None: ...

    def decisions(self, model: str, last: int = 20) -> list[dict[str, Any]]: ...

    def metrics_text(self) -> bytes: ...  # Prometheus text, served at the controller's /metrics

"""Frozen value types that cross stage boundaries (profile -> plan -> apply -> observe -> control).

No loose dicts between stages: a profile, a plan, a swap record, an
observation, what a re-plan policy sees at a tick, its estimate and decision,
and a tune's record are these. A plan has one wire format, `Plan.to_dict()` /
`Plan.from_dict()`, used by the CLI, the REST API, version directories,
decision lines and the bench; a decision (a line of decisions.jsonl, the REST
status) and a tune record (<state>/tune/<model>.json) have theirs the same
way; profiles have theirs in packrat.profile.store.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, replace
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
    # The request sizes its predictions are for: the timed sizes of the profile it was made
    # from, e.g. (("tokens", 5),) (profile_sizes). (): not known (no profile, or one made
    # before profiles recorded them). Says what a figure means, so takes no part in equality.
    sizes: tuple[tuple[str, int], ...] = field(default=(), compare=False)

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
        `mode` and `sizes` are written only when known (older records read back the same)."""
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
        if self.sizes:
            out["sizes"] = dict(self.sizes)
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
                sizes=_sizes(d.get("sizes")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed plan record: {d!r}") from exc


def ms_text(ms: float, spec: str = ".1f") -> str:
    """A latency as people read it: `spec` as usual, two significant digits below 1 ms,
    where ".0f" read a no-op model's 0.04 ms as "predicted 0 ms"."""
    return f"{ms:#.2g}" if 0 < ms < 1 else format(ms, spec)  # "#": 0.50, as the status page writes it


def profile_sizes(profile: Profile | None) -> tuple[tuple[str, int], ...]:
    """The request size per kind `profile` was timed at (its settings' "sizes", which
    packrat.profile.shape.timed_sizes reads too), sorted by kind; (): not known."""
    pairs = ((profile.extra.get("settings") or {}).get("sizes") or ()) if profile is not None else ()
    return tuple(sorted((str(k), int(v)) for k, v in pairs))


def _sizes(d: Any) -> tuple[tuple[str, int], ...]:
    """A record's {kind: size} (None or absent: not known) as sorted pairs."""
    if d is None:
        return ()
    if not isinstance(d, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in d.values()):
        raise ValueError(f"sizes is {d!r}, not kinds to sizes")
    return tuple(sorted((str(k), v) for k, v in d.items()))


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


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def _num(d: dict[str, Any], key: str, what: str, default: Any = None) -> Any:
    """d[key] as a number (int or float, not bool), `default` when absent or null."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"malformed {what}: {key} is {v!r}, not a number")
    return v


def _opt(d: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """d[key] when it is a `kind` or null/absent (None); ValueError naming the key otherwise."""
    v = d.get(key)
    if v is not None and not isinstance(v, kind):
        raise ValueError(f"malformed {what}: {key} is {v!r}")
    return v


def _object(d: Any, what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"malformed {what}: {d!r} is not an object")
    return d


@dataclass(frozen=True)
class Estimate:
    """The live batch B of a model at one tick (packrat.observe.estimator)."""

    time_s: float
    model: str
    batch: int  # smoothed B: the majority of recent rounded EWMA values
    ready: bool  # False until a majority of windows agreed (batch is then the prior one)
    concurrency: float | None = None  # raw Little's-law value of this window
    ewma: float | None = None
    rounded: int | None = None  # EWMA rounded to a power of two
    request_rate: float | None = None  # arrivals per second in the window
    mean_latency_ms: float | None = None  # Δ latency / Δ requests in the window
    mean_queue_ms: float | None = None
    span_s: float | None = None
    idle: bool = False  # no request arrived or finished in the window
    reset: bool = False  # counters went backwards: TorchServe restarted
    step: bool = False  # B jumped this tick (the step detector; the window restarted at the step)
    active_s: float | None = None  # newest sample that showed load (counters moved, or pending)

    @property
    def quiet_s(self) -> float | None:
        """Seconds since the load last showed (0 while busy); None: not known."""
        return None if self.active_s is None else max(0.0, self.time_s - self.active_s)

    @property
    def mean_service_ms(self) -> float | None:
        """Mean time from a worker taking a request off the queue to the response:
        what a profile predicts, without the waiting for a free worker."""
        if self.mean_latency_ms is None or self.mean_queue_ms is None:
            return None
        return self.mean_latency_ms - self.mean_queue_ms

    def to_dict(self) -> dict[str, Any]:
        """Every field, unrounded (a decision line carries a rounded subset: Decision.to_dict)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Any) -> Estimate:
        """Read `to_dict()`'s output back; ValueError names what is malformed."""
        d = _object(d, "estimate")
        if not isinstance(d.get("model"), str):
            raise ValueError(f"malformed estimate: model is {d.get('model')!r}")
        return cls(time_s=float(_num(d, "time_s", "estimate", 0.0)), model=d["model"],
                   batch=int(_num(d, "batch", "estimate", 1)), ready=bool(d.get("ready")),
                   **_estimate_figures(d, "estimate"), span_s=_num(d, "span_s", "estimate"))


def _estimate_figures(d: dict[str, Any], what: str) -> dict[str, Any]:
    """The figures an estimate shares with a decision line's "estimate" object."""
    rounded = _num(d, "rounded", what)
    return {"concurrency": _num(d, "concurrency", what), "ewma": _num(d, "ewma", what),
            "rounded": None if rounded is None else int(rounded),
            "request_rate": _num(d, "request_rate", what),
            "mean_latency_ms": _num(d, "mean_latency_ms", what),
            "mean_queue_ms": _num(d, "mean_queue_ms", what),
            "idle": bool(d.get("idle")), "reset": bool(d.get("reset")), "step": bool(d.get("step")),
            "active_s": _num(d, "active_s", what)}


@dataclass(frozen=True)
class Correction:
    """Per-model gap between observed and profiled latency (packrat.observe.policy's module doc)."""

    base: float = 1.0
    per_corunner: float = 0.0
    base_samples: int = 0  # one-worker ratios in base
    corunner_samples: int = 0
    last_ratio: float | None = None  # observed / predicted of the active plan, last tick
    # Multi-worker ratios folded into base while no one-worker plan had measured it
    # (0 once one has: its first ratio replaces such a base).
    pooled_samples: int = 0

    def factor(self, workers: int, min_samples: int = 0) -> float:
        """Expected observed/profiled latency of a plan with `workers` workers,
        using only the parts measured at least `min_samples` times. per_corunner
        counts only once base is measured on one-worker plans: contention is the
        excess over what one worker alone shows, unknown until that is known."""
        trusted = self.base_samples >= min_samples
        base = self.base if trusted or self.pooled_samples >= min_samples else 1.0
        pc = self.per_corunner if trusted and self.corunner_samples >= min_samples else 0.0
        return base * (1.0 + pc * max(workers - 1, 0))

    def to_dict(self) -> dict[str, Any]:
        """The wire format in a decision line; pooled_samples only when there are any,
        so lines of before write back the same bytes."""
        out: dict[str, Any] = {"base": _r(self.base), "per_corunner": _r(self.per_corunner),
                               "base_samples": self.base_samples,
                               "corunner_samples": self.corunner_samples}
        if self.pooled_samples:
            out["pooled_samples"] = self.pooled_samples
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Correction:
        """A decision line's correction (older lines lack pooled_samples: 0)."""
        what = "decision correction"
        return cls(base=float(_num(d, "base", what, 1.0)),
                   per_corunner=float(_num(d, "per_corunner", what, 0.0)),
                   base_samples=int(_num(d, "base_samples", what, 0)),
                   corunner_samples=int(_num(d, "corunner_samples", what, 0)),
                   pooled_samples=int(_num(d, "pooled_samples", what, 0)))


@dataclass(frozen=True)
class Decision:
    """One tick of the re-plan policy for one model (packrat.observe.policy.decide)."""

    time_s: float
    model: str
    swap: bool
    reason: str
    estimated_batch: int
    active_batch: int | None
    target: Plan | None  # the plan to swap to (the corrected choice), if any
    optimiser_choice: Plan | None  # candidates[0]
    current_ms: float | None  # active plan at estimated B, as profiled
    candidate_ms: float | None  # optimiser's choice, as profiled
    predicted_gain: float | None  # from profiles alone
    corrected_current_ms: float | None
    corrected_candidate_ms: float | None  # the corrected choice
    corrected_gain: float | None  # what the threshold is applied to
    correction_changed_choice: bool
    observed_ms: float | None  # mean service time (else latency) over the estimator window
    latency_gap: float | None  # observed/predicted - 1 of the active plan (settled)
    correction: Correction
    estimate: Estimate
    estimate_stable_s: float = 0.0  # how long the estimated B has held
    dwell_s: float | None = None  # the dwell the corrected gain asks for (None: no gain)
    # The request sizes the compared predictions are for (the timed sizes of the profile the
    # live plan is scored with), and the traffic's lately at the live plan's B; (): not known.
    predicted_for: tuple[tuple[str, int], ...] = ()
    traffic_sizes: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The decision's one wire format, flat-ish and rounded: a line of decisions.jsonl,
        an entry of the REST status. The sizes only when known (lines of before read back
        the same)."""
        c, e = self.correction, self.estimate
        sizes = {k: dict(v) for k, v in (("predicted_for", self.predicted_for),
                                         ("traffic_sizes", self.traffic_sizes)) if v}
        return {
            "time_s": round(self.time_s, 3),
            "model": self.model,
            "swap": self.swap,
            "reason": self.reason,
            "estimated_batch": self.estimated_batch,
            "active_batch": self.active_batch,
            "target": self.target.to_dict() if self.target else None,
            "optimiser_choice": self.optimiser_choice.to_dict() if self.optimiser_choice else None,
            "current_ms": _r(self.current_ms),
            "candidate_ms": _r(self.candidate_ms),
            "predicted_gain": _r(self.predicted_gain),
            "corrected_current_ms": _r(self.corrected_current_ms),
            "corrected_candidate_ms": _r(self.corrected_candidate_ms),
            "corrected_gain": _r(self.corrected_gain),
            "correction_changed_choice": self.correction_changed_choice,
            "estimate_stable_s": _r(self.estimate_stable_s, 3),
            "dwell_s": _r(self.dwell_s, 3),
            "observed_ms": _r(self.observed_ms),
            "latency_gap": _r(self.latency_gap),
            "correction": c.to_dict(),
            "estimate": {"ready": e.ready, "idle": e.idle, "reset": e.reset, "step": e.step,
                         "concurrency": _r(e.concurrency), "ewma": _r(e.ewma), "rounded": e.rounded,
                         "request_rate": _r(e.request_rate),
                         "mean_latency_ms": _r(e.mean_latency_ms),
                         "mean_queue_ms": _r(e.mean_queue_ms),
                         # when the load last showed; absent where not known (lines before it)
                         **({} if e.active_s is None else {"active_s": _r(e.active_s, 3)})},
            **sizes,
        }

    @classmethod
    def from_dict(cls, d: Any) -> Decision:
        """Read a decision line back (older lines lack step, dwell_s: their defaults);
        ValueError names what is malformed. The estimate keeps what the line carries
        (its B is estimated_batch; span_s is not written)."""
        d = _object(d, "decision")
        for key, kind in (("model", str), ("reason", str), ("swap", bool)):
            if not isinstance(d.get(key), kind):
                raise ValueError(f"malformed decision: {key} is {d.get(key)!r}")
        est, corr = _object(d.get("estimate"), "decision estimate"), _object(d.get("correction"), "decision correction")
        time_s, batch = float(_num(d, "time_s", "decision", 0.0)), int(_num(d, "estimated_batch", "decision", 1))
        active = _num(d, "active_batch", "decision")
        return cls(
            time_s=time_s, model=d["model"], swap=d["swap"], reason=d["reason"], estimated_batch=batch,
            active_batch=None if active is None else int(active),
            target=None if d.get("target") is None else Plan.from_dict(d["target"]),
            optimiser_choice=None if d.get("optimiser_choice") is None else Plan.from_dict(d["optimiser_choice"]),
            **{k: _num(d, k, "decision") for k in (
                "current_ms", "candidate_ms", "predicted_gain", "corrected_current_ms",
                "corrected_candidate_ms", "corrected_gain", "observed_ms", "latency_gap", "dwell_s")},
            correction_changed_choice=bool(d.get("correction_changed_choice")),
            correction=Correction.from_dict(corr),
            estimate=Estimate(time_s=time_s, model=d["model"], batch=batch, ready=bool(est.get("ready")),
                              **_estimate_figures(est, "decision estimate")),
            estimate_stable_s=float(_num(d, "estimate_stable_s", "decision", 0.0)),
            predicted_for=_sizes(d.get("predicted_for")), traffic_sizes=_sizes(d.get("traffic_sizes")),
        )


def _str_map(d: dict[str, Any], key: str, what: str) -> dict[str, str]:
    v = _opt(d, key, dict, what) or {}
    if not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise ValueError(f"malformed {what}: {key} is {v!r}, not names to texts")
    return dict(v)


def _in_order(order: tuple[str, ...], values: dict[str, Any]) -> dict[str, Any]:
    """`values` in the key order a record was written in (a record reads back byte for byte)."""
    return {k: copy.deepcopy(values[k]) for k in order}


@dataclass(frozen=True)
class TunePlanRow:
    """One mode's best plan at a tune's batch, or why it has none (packrat.tune.run._choose)."""

    mode: str
    predicted_ms: float | None = None  # None: no plan (reason says why)
    fat_ms: float | None = None
    shape: str | None = None  # e.g. "2x(t1,b2)"
    reason: str | None = None
    kept: str | None = None  # why it was chosen before a faster later mode (the margin)

    def to_dict(self) -> dict[str, Any]:
        if self.predicted_ms is None:
            return {"mode": self.mode, "reason": self.reason}
        out: dict[str, Any] = {"mode": self.mode, "predicted_ms": self.predicted_ms,
                               "fat_ms": self.fat_ms, "shape": self.shape}
        if self.kept is not None:
            out["kept"] = self.kept
        return out

    @classmethod
    def from_dict(cls, d: Any) -> TunePlanRow:
        """Read `to_dict()`'s output back; ValueError names what is malformed."""
        what = "tune plan row"
        d = _object(d, what)
        if not isinstance(d.get("mode"), str):
            raise ValueError(f"malformed {what}: mode is {d.get('mode')!r}")
        return cls(mode=d["mode"], predicted_ms=_num(d, "predicted_ms", what), fat_ms=_num(d, "fat_ms", what),
                   shape=_opt(d, "shape", str, what), reason=_opt(d, "reason", str, what),
                   kept=_opt(d, "kept", str, what))


@dataclass(frozen=True)
class TuneModeRecord:
    """One mode's entry in a tune record: how far it got, and why it went no further."""

    state: str | None = None  # pending guarding profiling profiled reused refused failed skipped
    reason: str | None = None  # why refused, failed or skipped
    model_id: str | None = None  # the archive a refusal holds for
    fingerprint: dict[str, Any] | None = field(default=None, hash=False)  # the machine + mode of a refusal
    plan: TunePlanRow | None = None  # its best plan at the tune's batch, or why none
    # What the record says besides (path, points, guard, build_s, budget_s, why, note, ...).
    detail: dict[str, Any] = field(default_factory=dict, hash=False)
    # The keys in the order they were written (to_dict keeps it); derived when not given.
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    _TYPED = ("state", "reason", "model_id", "fingerprint", "plan")

    def __post_init__(self) -> None:
        if not self.order:
            present = tuple(k for k in self._TYPED if getattr(self, k) is not None)
            object.__setattr__(self, "order", present + tuple(self.detail))

    def to_dict(self) -> dict[str, Any]:
        values = {k: getattr(self, k) for k in self._TYPED}
        values["plan"] = self.plan.to_dict() if self.plan is not None else None
        return _in_order(self.order, {**values, **self.detail})

    @classmethod
    def from_dict(cls, d: Any) -> TuneModeRecord:
        """Read `to_dict()`'s output back; ValueError names what is malformed."""
        what = "tune mode record"
        d = _object(d, what)
        plan = d.get("plan")
        return cls(state=_opt(d, "state", str, what), reason=_opt(d, "reason", str, what),
                   model_id=_opt(d, "model_id", str, what), fingerprint=_opt(d, "fingerprint", dict, what),
                   plan=None if plan is None else TunePlanRow.from_dict(plan),
                   detail={k: v for k, v in d.items() if k not in cls._TYPED}, order=tuple(d))

    def updated(self, **fields: Any) -> TuneModeRecord:
        """These fields (in their wire form) set, as a dict update would: new keys go last."""
        return TuneModeRecord.from_dict({**self.to_dict(), **fields})


# A tune record's typed fields: (key, kind). "number" is int or float; the rest are parsed below.
_TUNE_FIELDS: tuple[tuple[str, Any], ...] = (
    ("model", str), ("state", str), ("stage", str), ("text", str), ("trigger", str),
    ("created", "number"), ("started", "number"), ("finished", "number"), ("batch", "number"),
    ("budget_s", "number"), ("candidates", "names"), ("modes", "modes"), ("skipped", "texts"),
    ("choice", "plan"), ("swap", dict), ("error", str), ("key", dict), ("capabilities", dict),
    ("model_id", str), ("mode", str), ("points_done", "number"), ("points_total", "number"),
)


@dataclass(frozen=True)
class TuneRecord:
    """A tune of one model as packrat.tune.Tracker writes it (<state>/tune/<model>.json, the
    REST status's "tune", a tune job's progress): its stage, every mode's entry, the choice,
    its swap and the key it is valid for (base archive, its hash, the machine)."""

    model: str | None = None
    state: str | None = None  # queued running done failed
    stage: str | None = None  # queued probing guarding profiling planning applying applied pinned failed
    text: str | None = None  # the stage in words
    trigger: str | None = None  # "request", "auto: <why>"
    created: float | None = None
    started: float | None = None
    finished: float | None = None
    batch: int | None = None  # the load batch B the choice is made for
    budget_s: float | None = None
    candidates: tuple[str, ...] = ()
    modes: dict[str, TuneModeRecord] = field(default_factory=dict, hash=False)
    skipped: dict[str, str] = field(default_factory=dict, hash=False)  # mode -> why it is not tried
    choice: Plan | None = None  # the (mode, plan) chosen
    swap: dict[str, Any] | None = field(default=None, hash=False)  # SwapRecord.to_dict() or an outcome
    error: str | None = None
    key: dict[str, Any] | None = field(default=None, hash=False)  # packrat.tune.tune_key
    capabilities: dict[str, Any] | None = field(default=None, hash=False)  # the probe's (Capabilities.to_dict)
    model_id: str | None = None  # the base archive's content hash
    mode: str | None = None  # the mode being measured
    points_done: int | None = None
    points_total: int | None = None
    detail: dict[str, Any] = field(default_factory=dict, hash=False)  # keys this type does not know
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)  # as TuneModeRecord.order

    def __post_init__(self) -> None:
        if not self.order:
            present = tuple(k for k, _ in _TUNE_FIELDS if getattr(self, k) not in (None, (), {}))
            object.__setattr__(self, "order", present + tuple(self.detail))

    def to_dict(self) -> dict[str, Any]:
        values = {k: getattr(self, k) for k, _ in _TUNE_FIELDS}
        values.update(candidates=list(self.candidates), skipped=dict(self.skipped),
                      modes={m: r.to_dict() for m, r in self.modes.items()},
                      choice=self.choice.to_dict() if self.choice is not None else None)
        return _in_order(self.order, {**values, **self.detail})

    @classmethod
    def from_dict(cls, d: Any) -> TuneRecord:
        """Read `to_dict()`'s output back (any key may be missing: its default); ValueError
        names what is malformed."""
        d = _object(d, "tune record")
        typed = {k: _tune_field(d, k, kind) for k, kind in _TUNE_FIELDS}
        for k in ("batch", "points_done", "points_total"):
            typed[k] = None if typed[k] is None else int(typed[k])
        known = {k for k, _ in _TUNE_FIELDS}
        return cls(**typed, detail={k: v for k, v in d.items() if k not in known}, order=tuple(d))

    def updated(self, **fields: Any) -> TuneRecord:
        """These fields (in their wire form) set, as a dict update would: new keys go last."""
        return TuneRecord.from_dict({**self.to_dict(), **fields})

    def with_mode(self, mode: str, **fields: Any) -> TuneRecord:
        """Mode `mode`'s entry updated with these fields (created when new)."""
        entry = self.modes.get(mode, TuneModeRecord()).updated(**fields)
        return replace(self, modes={**self.modes, mode: entry},
                       order=self.order if "modes" in self.order else self.order + ("modes",))


def _tune_field(d: dict[str, Any], key: str, kind: Any) -> Any:
    what = "tune record"
    if kind == "number":
        return _num(d, key, what)
    if kind == "names":
        v = _opt(d, key, list, what) or []
        if not all(isinstance(x, str) for x in v):
            raise ValueError(f"malformed {what}: {key} is {v!r}, not a list of modes")
        return tuple(v)
    if kind == "texts":
        return _str_map(d, key, what)
    if kind == "modes":
        try:
            return {m: TuneModeRecord.from_dict(r) for m, r in (_opt(d, key, dict, what) or {}).items()}
        except ValueError as exc:
            raise ValueError(f"malformed {what}: modes: {exc}") from None
    if kind == "plan":
        return None if d.get(key) is None else Plan.from_dict(d[key])
    return _opt(d, key, kind, what)


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
    # The traffic's representative request sizes lately at the live plan's B
    # (packrat.control.traffic.TrafficShapes.recent); (): too few requests, or not read.
    traffic: tuple[tuple[str, int], ...] = ()


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

    def last_decisions(self, model: str, last: int = 20) -> list[Decision]: ...

    def decisions(self, model: str, last: int = 20) -> list[dict[str, Any]]: ...  # wire format

    def metrics_text(self) -> bytes: ...  # Prometheus text, served at the controller's /metrics

"""Frozen value types that cross stage boundaries (profile -> plan -> apply -> observe).

No loose dicts between stages: a profile, a plan and an observation are these.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Latency of one isolated instance with `threads` intra-op threads at batch `batch`."""

    threads: int
    batch: int
    mean_ms: float
    p50_ms: float | None = None
    p99_ms: float | None = None
    std_ms: float | None = None
    count: int | None = None
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
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def latency(self, threads: int, batch: int) -> float | None:
        for p in self.points:
            if p.threads == threads and p.batch == batch:
                return p.mean_ms
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


@dataclass(frozen=True)
class Observation:
    """One reading of the live load on a model, taken from TorchServe's own signals."""

    time_s: float
    model: str
    requests_total: float
    latency_us_total: float
    queue_latency_us_total: float | None = None
    pending_requests: int | None = None

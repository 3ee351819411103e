"""What is live, read from TorchServe: one ModelState per request or tick, and the
observed latency from its metrics port.

What is live is read back from TorchServe (the default version of each model)
and from the version directory it was registered from (the plan travels in its
model_config.yaml), so a restarted controller knows it without a state file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from packrat.apply import versions
from packrat.apply.client import ManagementClient, scrape_metrics
from packrat.apply.swap import Swapper, check_workers
from packrat.control.values import ModelState, ObservedLatency, WorkerState
from packrat.observe import metrics
from packrat.types import Observation


def read_model_state(client: ManagementClient, model_store: Path, model: str) -> ModelState:
    """The live version of `model` (two management calls); TorchServeError 404 if unknown."""
    d = client.describe_model(model)
    path = model_store / d.url
    vdir = versions.load_version(path) if (path / versions.MANIFEST).exists() else None
    others = tuple(x.version for x in client.describe_versions(model) if x.version != d.version)
    checks = {c.pid: c for c in check_workers(d, vdir)} if vdir is not None else {}
    return ModelState(
        model=model,
        version=d.version,
        url=d.url,
        plan=vdir.plan if vdir else None,
        workers=tuple(WorkerState.of(w, checks.get(w.pid)) for w in d.workers),
        other_versions=others,
        mode=versions.served_mode(path),
        cores=tuple(sorted({c for sl in vdir.slots for c in sl.cores})) if vdir else None,
    )


def base_of(swapper: Swapper, model_store: Path, st: ModelState) -> tuple[str, Path]:
    """(name, path) of the base archive behind the live version `st`."""
    base = swapper.base_of(st.url)
    return base, model_store / base


class Observer:
    """TorchServe's request counters per model, and the mean latency between two readings."""

    def __init__(self, metrics_url: str | None, clock: Callable[[], float]) -> None:
        self.metrics_url = metrics_url
        self.clock = clock
        self._last: dict[str, Observation] = {}

    def observe(self, model: str) -> Observation | None:
        """Cumulative request count and latency of `model` from TorchServe's metrics port.

        Summed over the version labels: unversioned traffic is labelled "default"
        whichever version serves it.
        """
        if not self.metrics_url:
            return None
        return metrics.observation(scrape_metrics(self.metrics_url), model, self.clock())

    def observed_latency(self, model: str) -> ObservedLatency | None:
        """Mean latency (ms) overall and since the previous call, from counter deltas."""
        obs = self.observe(model)
        if obs is None:
            return None
        prev = self._last.get(model)
        self._last[model] = obs
        overall = (obs.latency_us_total / obs.requests_total / 1000.0) if obs.requests_total else None
        if prev is None:
            return ObservedLatency(obs.requests_total, overall)
        recent = metrics.window_means(prev, obs)
        return ObservedLatency(obs.requests_total, overall, recent.mean_latency_ms,
                               round(obs.time_s - prev.time_s, 3))

"""What is live, read from TorchServe: one ModelState per request or tick, and the
observed latency from its metrics port.

What is live is read back from TorchServe (the default version of each model)
and from the version directory it was registered from (the plan travels in its
model_config.yaml), so a restarted controller knows it without a state file.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from packrat.apply import versions
from packrat.apply.client import ManagementClient, scrape_metrics, session_for
from packrat.apply.swap import Swapper, check_workers
from packrat.control.values import ModelState, ObservedLatency, WorkerState
from packrat.errors import ConfigError
from packrat.observe import metrics
from packrat.types import Observation


def read_model_state(client: ManagementClient, model_store: Path, model: str, *,
                     others: bool = True, default_url: str | None = None) -> ModelState:
    """The live version of `model` (two management calls; one without `others`, whose
    other_versions is then () and whose workers are not checked against their slots
    (WorkerState.check None): a tick uses neither); TorchServeError 404 if unknown.
    `default_url`: the default version's directory as TorchServe's list of models named it
    (a tick's): then one call, describing every version, when the default is among them."""
    listed = client.describe_versions(model) if others and default_url is not None else ()
    d = next((x for x in listed if x.url == default_url), None) or client.describe_model(model)
    path = model_store / d.url
    vdir, mode = _DIRS.read(path)
    if others:
        other = tuple(x.version for x in (listed or client.describe_versions(model)) if x.version != d.version)
    else:
        other = ()
    checks = {c.pid: c for c in check_workers(d, vdir)} if vdir is not None and others else {}
    return ModelState(
        model=model,
        version=d.version,
        url=d.url,
        plan=vdir.plan if vdir else None,
        workers=tuple(WorkerState.of(w, checks.get(w.pid)) for w in d.workers),
        other_versions=other,
        mode=mode,
        cores=tuple(sorted({c for sl in vdir.slots for c in sl.cores})) if vdir else None,
    )


class _DirReads:
    """A registered directory's version and mode, parsed again only when its manifest,
    model_config.yaml or the directory itself changed (every tick reads every model's:
    YAML parsing was most of an idle model's cost). Bounded; errors are not kept."""

    SIZE = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[Path, tuple[tuple[tuple[int, int, int] | None, ...], Any]] = {}

    @staticmethod
    def _key(path: Path) -> tuple[tuple[int, int, int] | None, ...]:
        out = []
        for p in (path, path / versions.MANIFEST, path / versions.CONFIG):
            try:
                st = p.stat()
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def read(self, path: Path) -> tuple[versions.VersionDir | None, str | None]:
        key = self._key(path)
        with self._lock:
            hit = self._seen.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = (versions.load_version(path) if key[1] is not None else None, versions.served_mode(path))
        with self._lock:
            if len(self._seen) >= self.SIZE:
                self._seen.pop(next(iter(self._seen)))
            self._seen[path] = (key, value)
        return value


_DIRS = _DirReads()


def served_mode(path: Path) -> str | None:
    """versions.served_mode of a registered directory, parsed again only when its files change
    (GET /metrics asks it of every model's last plan at each scrape)."""
    try:
        return _DIRS.read(path)[1]
    except ConfigError:  # a broken version: what versions.served_mode says of it
        return versions.served_mode(path)


def base_of(swapper: Swapper, model_store: Path, st: ModelState) -> tuple[str, Path]:
    """(name, path) of the base archive behind the live version `st`."""
    # What swapper.base_of(st.url) reads, from the parsed directories kept (_DirReads).
    vdir, _ = _DIRS.read(swapper.model_store / st.url)
    base = vdir.base if vdir else st.url
    return base, model_store / base


def require_plannable(st: ModelState, what: str) -> None:
    """ConfigError unless the live version's config has a `packrat.task` (st.mode), the mark of
    an archive whose handler claims and pins a plan's slots (packrat_handler.py, or one of
    its own that calls packrat.slots.claim_and_pin, as the tests' sleep model does)."""
    if st.mode is None:
        raise ConfigError(f"{st.model}: its live version is not a Packrat archive (no packrat.task in its "
                          f"model_config.yaml): {what}; build one with `packrat archive`")


def packrat_base(swapper: Swapper, model_store: Path, st: ModelState) -> tuple[str, Path] | None:
    """base_of() the live version `st` when it is served by Packrat's own handler (its
    execution modes can be tried), else None."""
    if st.mode is None:
        return None
    base, base_dir = base_of(swapper, model_store, st)
    return (base, base_dir) if (base_dir / "packrat_handler.py").is_file() else None


def require_packrat(swapper: Swapper, model_store: Path, st: ModelState, what: str) -> tuple[str, Path]:
    """packrat_base(), or ConfigError saying why `what` needs one."""
    found = packrat_base(swapper, model_store, st)
    if found is None:
        raise ConfigError(f"{st.model}: its live version is not a Packrat archive (no packrat_handler.py or "
                          f"packrat.task): {what}; build one with `packrat archive`")
    return found


class Observer:
    """TorchServe's request counters per model, and the mean latency between two readings.

    Within one_scrape() (a tick), the thread that entered it scrapes once for every model.
    Another thread may take the latest round's reading instead of scraping, when it is at
    most `max_age_s` old (a status answer: the tick's, when the tick is fresh).
    """

    def __init__(self, metrics_url: str | None, clock: Callable[[], float]) -> None:
        self.metrics_url = metrics_url
        self.clock = clock
        self._last: dict[str, Observation] = {}
        # .obs: this thread's one reading of every model in a round, or None; .session: its HTTP session
        self._round = threading.local()
        self._latest: tuple[float, dict[str, Observation]] | None = None  # (time.monotonic(), a round's)
        self.scrapes = 0  # how many times the metrics port was read (tests: once per tick)

    @contextlib.contextmanager
    def one_scrape(self) -> Iterator[None]:
        """In this thread, observe() reads the metrics port at most once until the block ends."""
        self._round.obs = {}
        try:
            yield
        finally:
            self._round.obs = None

    def _scrape(self) -> str:
        assert self.metrics_url is not None
        self.scrapes += 1
        session = getattr(self._round, "session", None)
        if session is None:  # one kept-alive connection per thread, not a new one per scrape
            session = self._round.session = session_for(self.metrics_url)
        # Only the three request counters (metrics_mode prometheus also sends the host's and
        # every worker's series: 3.3 kB for two models, their parse 4x this one's).
        return scrape_metrics(self.metrics_url, session=session, query=metrics.METRICS_QUERY)

    def observe(self, model: str, max_age_s: float | None = None) -> Observation | None:
        """Cumulative request count and latency of `model` from TorchServe's metrics port.

        Summed over the version labels: unversioned traffic is labelled "default"
        whichever version serves it. `max_age_s`: outside a round, the latest round's reading
        when it is at most that old.
        """
        if not self.metrics_url:
            return None
        seen: dict[str, Observation] | None = getattr(self._round, "obs", None)
        if seen is None:
            latest = self._latest
            if max_age_s is not None and latest is not None and time.monotonic() - latest[0] <= max_age_s:
                return self._of(latest[1], model)
            return metrics.observation(self._scrape(), model, self.clock())
        if not seen:  # the round's one scrape; "" marks it taken (a model with no series yet)
            text, now = self._scrape(), self.clock()
            seen.update(metrics.observations(text, now), **{"": metrics.observation("", "", now)})
            self._latest = (time.monotonic(), seen)  # not changed after: other threads may read it
        return self._of(seen, model)

    @staticmethod
    def _of(seen: dict[str, Observation], model: str) -> Observation:
        found = seen.get(model)
        return found if found is not None else replace(seen[""], model=model)

    def observed_latency(self, model: str, max_age_s: float | None = None) -> ObservedLatency | None:
        """Mean latency (ms) overall and since the previous call, from counter deltas
        (`max_age_s`: see observe)."""
        obs = self.observe(model, max_age_s)
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

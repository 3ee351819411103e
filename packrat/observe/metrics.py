"""TorchServe 0.12 Prometheus text -> Observation (per model).

What TorchServe 0.12 exports (read from frontend/server/.../RestJob.java and
InferenceRequestHandler.java at tag v0.12.0, and checked against a live 0.12.0
server; tests/data/observe/two_versions.prom is a real scrape):

    ts_inference_requests_total{model_name,model_version,hostname}
        +1 when a request *arrives* (before it is queued)
    ts_inference_latency_microseconds{model_name,model_version,hostname}
        += arrival -> response time of every *answered* request, so it
        includes the time spent in the job queue
    ts_queue_latency_microseconds{model_name,model_version,hostname}
        += arrival -> taken-by-a-worker time

All three are counters: they only grow, and start again from zero when
TorchServe restarts.

Why versions are summed: `model_version` is the version the client *asked
for*, not the one that served the request. Ordinary traffic goes to
/predictions/{m} and is labelled "default" whichever version is the default;
requests pinned with /predictions/{m}/{v} are labelled "v". So during a swap
the old and the new version serve one stream of client load that the labels
cannot split, and the load on the model (what B measures) is the sum over
all labels. A caller that pins its own warm-up requests to a version can
leave that label out with `exclude_versions`.
"""

from __future__ import annotations

from collections.abc import Iterable
import dataclasses
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from packrat.types import Observation

# Family names as prometheus_client's parser reports them: it strips "_total"
# from counter family names (and appends it to sample names that lack it).
REQUESTS = "ts_inference_requests"
LATENCY = "ts_inference_latency_microseconds"
QUEUE_LATENCY = "ts_queue_latency_microseconds"
_WANTED = (REQUESTS, LATENCY, QUEUE_LATENCY)

# Ask the metrics endpoint for these only: the rest (disk, memory, ...) is noise here.
METRICS_QUERY = "&".join(f"name[]={n}" for n in (f"{REQUESTS}_total", LATENCY, QUEUE_LATENCY))


@dataclass(frozen=True)
class CounterSample:
    """One counter series: family name (without _total), its labels, its value."""

    family: str
    model: str
    version: str
    value: float


def _family(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


def parse_counters(text: str) -> list[CounterSample]:
    """Every series of the three TorchServe request counters in a scrape."""
    out: list[CounterSample] = []
    for family in text_string_to_metric_families(text):
        fam = _family(family.name)
        if fam not in _WANTED:
            continue
        for s in family.samples:
            # Skip the "_created" timestamps some exporters add to counters.
            if s.name.endswith("_created"):
                continue
            model = s.labels.get("model_name")
            if model is None:
                continue
            out.append(CounterSample(fam, model, s.labels.get("model_version", "default"), s.value))
    return out


def observations(
    text: str,
    time_s: float,
    *,
    exclude_versions: Iterable[str] = (),
    pending: dict[str, int] | None = None,
) -> dict[str, Observation]:
    """One Observation per model found in the scrape, versions summed (see module doc).

    `time_s` is the caller's clock reading when it scraped (the text has no
    timestamps); `pending` optionally maps model -> queued requests from the
    describe API.
    """
    excluded = set(exclude_versions)
    sums: dict[str, dict[str, float]] = {}
    for c in parse_counters(text):
        if c.version in excluded:
            continue
        per_model = sums.setdefault(c.model, {})
        per_model[c.family] = per_model.get(c.family, 0.0) + c.value
    obs: dict[str, Observation] = {}
    for model, v in sums.items():
        obs[model] = Observation(
            time_s=time_s,
            model=model,
            requests_total=v.get(REQUESTS, 0.0),
            latency_us_total=v.get(LATENCY, 0.0),
            queue_latency_us_total=v.get(QUEUE_LATENCY),
            pending_requests=None if pending is None else pending.get(model),
        )
    return obs


def observation(
    text: str,
    model: str,
    time_s: float,
    *,
    exclude_versions: Iterable[str] = (),
    pending_requests: int | None = None,
) -> Observation:
    """The Observation of one model; all-zero counters if it has served nothing yet.

    TorchServe creates a model's series on its first request, so a model
    missing from the scrape has simply had no traffic since the server started.
    """
    found = observations(text, time_s, exclude_versions=exclude_versions).get(model)
    if found is None:
        return Observation(time_s=time_s, model=model, requests_total=0.0, latency_us_total=0.0,
                           queue_latency_us_total=0.0, pending_requests=pending_requests)
    if pending_requests is not None:
        found = dataclasses.replace(found, pending_requests=pending_requests)
    return found


@dataclass(frozen=True)
class WindowMeans:
    """What the counters say about the requests between two readings of one model."""

    requests: float  # arrivals
    latency_us: float  # summed latency of the requests answered
    mean_latency_ms: float | None  # None until a request has been answered
    mean_queue_ms: float | None  # None when unanswered or the queue counter is unknown


def window_means(base: Observation, obs: Observation) -> WindowMeans:
    """Counter deltas from `base` to `obs` and the mean latency / queue time per request.

    Arrivals are counted when they come in, latency when they finish: a window
    at the start of a load can hold arrivals and no finished request yet, and
    then has no mean.
    """
    d_req = obs.requests_total - base.requests_total
    d_lat_us = obs.latency_us_total - base.latency_us_total
    answered = d_req > 0 and d_lat_us > 0
    d_queue_us = None
    if obs.queue_latency_us_total is not None and base.queue_latency_us_total is not None:
        d_queue_us = obs.queue_latency_us_total - base.queue_latency_us_total
    return WindowMeans(
        requests=d_req,
        latency_us=d_lat_us,
        mean_latency_ms=d_lat_us / d_req / 1000.0 if answered else None,
        mean_queue_ms=d_queue_us / d_req / 1000.0 if (answered and d_queue_us is not None) else None,
    )


def pending_from_describe(describe: list[dict]) -> int:
    """Queued requests of a model: the sum of jobQueueStatus.pendingRequests over
    the versions in a `GET /models/{m}/all` answer (queued jobs only; batches
    a worker is running are not counted)."""
    total = 0
    for version in describe:
        q = version.get("jobQueueStatus") or {}
        total += int(q.get("pendingRequests", 0) or 0)
    return total

"""The shape of the traffic each model serves: the sizes its live workers counted.

Every worker counts the size of each request it serves (text tokens, image pixels,
generated tokens) in a histogram in its mapped counters (packrat.worker_counters,
written by the handler, no system call). Summed over a model's live workers, that is
the distribution of what the live version has served since its workers started (a
swap starts new workers, so it is also "since the last swap"). Status shows it per
model, and /metrics as packrat_traffic_size{model, kind, stat} and
packrat_traffic_requests{model, kind}: which input shape the traffic has, beside the
one the plan's prediction is for (status's predicted_for, packrat_prediction_size{model,
kind}: the timed sizes of the profile the plan was made from).

Reading it costs one small file read per worker (no call to TorchServe); it is read
whenever a ModelState is (status, and each tick), and /metrics reports the last reading.
The ticks' readings also say what each model served lately (TrafficShapes.recent,
packrat.profile.shape.RecentSizes): the re-plan loop's TickContext.traffic, against which
it checks that a prediction is for the traffic before learning from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from packrat import slots
from packrat.control.values import ModelState
from packrat.profile.shape import RECENT_S, RecentSizes, representative_sizes, shifted, sizes_by_batch
from packrat.types import TuneRecord
from packrat.worker_counters import SIZE_KINDS, SizeHistogram

QUANTILES = {"p50": 0.5, "p90": 0.9}


def worker_sizes(st: ModelState) -> dict[int, dict[str, SizeHistogram]]:
    """{pid: {kind: histogram}} of the model's live workers that have one."""
    out: dict[int, dict[str, SizeHistogram]] = {}
    for worker in st.workers:
        pid = worker.described.get("pid")
        sizes = slots.read_worker_sizes(pid) if isinstance(pid, int) and pid > 0 else None
        if sizes is not None:
            out[pid] = sizes
    return out


def served_sizes(st: ModelState, reading: Mapping[int, Mapping[str, SizeHistogram]] | None = None,
                 ) -> dict[str, SizeHistogram] | None:
    """{kind: histogram} summed over the model's live workers (`reading`: worker_sizes(st),
    read here when not given); None when no worker has one (a version Packrat did not
    build, or workers still starting)."""
    total: dict[str, SizeHistogram] | None = None
    for sizes in (worker_sizes(st) if reading is None else reading).values():
        total = dict(sizes) if total is None else {kind: total[kind] + sizes[kind] for kind in SIZE_KINDS}
    return total


def shape(sizes: Mapping[str, SizeHistogram] | None) -> dict[str, dict[str, Any]] | None:
    """Per kind with requests: how many, their mean size and quantiles (sizes read from
    buckets exact below 16, half-octaves above: within ~20 %). {}: no request served yet."""
    if sizes is None:
        return None
    out: dict[str, dict[str, Any]] = {}
    for kind, hist in sizes.items():
        if hist.requests:
            out[kind] = {"requests": hist.requests, "mean": round(hist.mean() or 0.0, 1),
                         **{name: round(hist.quantile(q) or 0.0, 1) for name, q in QUANTILES.items()}}
    return out


def plan_batch(st: ModelState) -> int:
    """The load batch the live plan was made for (1: no Packrat plan)."""
    return st.plan.batch if st.plan is not None else 1


def profile_sizes(st: ModelState, batch: int) -> tuple[tuple[str, int], ...]:
    """The request sizes to profile `st`'s model at for load batch `batch`: the traffic's
    (packrat.profile.shape.representative_sizes); (): the task's own sample, until traffic exists."""
    sizes = served_sizes(st)
    return representative_sizes(sizes, batch) if sizes else ()


def profile_shape(st: ModelState, batch: int, max_batch: int,
                  ) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[int, tuple[tuple[str, int], ...]], ...]]:
    """From one reading of the workers' histograms: the sizes to profile at for load batch
    `batch` (profile_sizes: the profile's label) and the batches 1..max_batch to time at
    other sizes (packrat.profile.shape.sizes_by_batch); both (): no traffic yet."""
    sizes = served_sizes(st)
    if not sizes:
        return (), ()
    label = representative_sizes(sizes, batch)
    return label, sizes_by_batch(sizes, range(1, max_batch + 1), label)


def _moved(before: Mapping[str, int], st: ModelState, batch: int) -> str | None:
    """Why sizes measured at `before` no longer describe the traffic at load batch `batch`
    (packrat.profile.shape.shifted), or None; None too while there is no traffic to compare
    with. Sizes not known (`before` empty: a tune or profile made before they were recorded)
    count as moved once there is traffic: the caller's own record of what it then measured
    (the new profile's or tune's sizes, the Reprofiler's `tried`) keeps that to one try."""
    now = dict(profile_sizes(st, batch))
    moved = shifted(before, now)
    return why_moved(before, now, moved) if moved else None


def why_moved(before: Mapping[str, int], now: Mapping[str, int], moved: Iterable[str]) -> str:
    """The words for a shift of the sizes `moved` from `before` (empty: not known) to `now`:
    an automatic tune's and the Reprofiler's reason, in logs and status."""
    if not before:
        return "input shape profiled at is not known (made before sizes were recorded); traffic's: " + ", ".join(
            f"{k} {now[k]}" for k in moved)
    return "traffic's input shape moved (" + ", ".join(
        f"{k} {before.get(k, 'none')} -> {now[k]}" for k in moved) + ")"


def why_retune(record: TuneRecord | None, st: ModelState) -> str | None:
    """Why the model needs tuning again for its traffic (None: it does not): the traffic
    sizes its last finished tune profiled at moved beyond packrat.profile.shape.SHIFT_FACTOR
    from the traffic's now. A tune records its sizes whether it succeeds or fails, so a
    shift starts one tune, not one per check; a tune made before there was traffic records
    the task's sample's (the chosen mode's profile's), compared the same way. A finished
    tune whose sizes are not known (made before they were recorded) is tuned again once
    there is traffic; a failed one is not (why_tune: no automatic retry of a failure)."""
    if record is None or record.state not in ("done", "failed"):
        return None
    before = {str(k): int(v) for k, v in (record.detail.get("sizes") or {}).items()}
    if not before and record.state == "failed":
        return None
    return _moved(before, st, record.batch or 1)


class TrafficShapes:
    """The last traffic shape read per model, and a Prometheus collector of it; and, from the
    ticks' readings, what each model served lately (packrat.profile.shape.RecentSizes)."""

    def __init__(self, window_s: float = RECENT_S) -> None:
        self._last: dict[str, dict[str, dict[str, Any]]] = {}
        self._recent = RecentSizes(window_s)
        self._lately: dict[str, dict[str, SizeHistogram]] = {}

    def update(self, st: ModelState, now: float | None = None) -> dict[str, dict[str, Any]] | None:
        """Read `st`'s workers now; returns the shape (status shows it). `now`: the tick's
        clock, the reading then also counts towards recent() (a status read does not)."""
        reading = worker_sizes(st)
        found = shape(served_sizes(st, reading))
        if found is None:
            self._last.pop(st.model, None)
        else:
            self._last[st.model] = found
        if now is not None:
            self._lately[st.model] = self._recent.update(st.model, now, reading)
        return found

    def update_all(self, states: Iterable[ModelState], now: float | None = None) -> None:
        """A tick's reading of every model: models no longer listed are forgotten."""
        states = list(states)
        for st in states:
            self.update(st, now)
        listed = {st.model for st in states}
        for model in set(self._last) - listed:
            self._last.pop(model, None)
        for model in set(self._lately) - listed:
            self._lately.pop(model, None)

    def recent(self, model: str, batch: int) -> tuple[tuple[str, int], ...]:
        """The sizes to plan what `model` served lately (the last ~window_s of ticks) at load
        batch `batch` (packrat.profile.shape.representative_sizes); (): too few requests."""
        lately = self._lately.get(model)
        return representative_sizes(lately, batch) if lately else ()

    def describe(self) -> list[Any]:
        return []  # registering must not read anything

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        size = GaugeMetricFamily("packrat_traffic_size", "Size of the requests the model's live workers "
                                 "served (kind: tokens, pixels, generated; stat: mean, p50, p90)",
                                 labels=["model", "kind", "stat"])
        requests = GaugeMetricFamily("packrat_traffic_requests", "Requests the model's live workers counted "
                                     "in their size histograms, per kind", labels=["model", "kind"])
        for model, kinds in sorted(dict(self._last).items()):
            for kind, row in kinds.items():
                requests.add_metric([model, kind], row["requests"])
                for stat in ("mean", *QUANTILES):
                    size.add_metric([model, kind, stat], row[stat])
        return [size, requests]

"""The input shape to profile for: representative request sizes of the traffic served.

A profile times one request size per kind (ProfileSettings.sizes; none: the task's
own sample, e.g. a text of max_length tokens) and records the sizes it timed in its
settings (timed_sizes()): those asked for, and the sample's own as the served worker
counts them (Task.served_sizes), so a profile made before there was traffic is
compared with the traffic like any other. The workers' size histograms
(packrat.worker_counters, summed per model by packrat.control.traffic) say what the
traffic really sends since they started; RecentSizes, what it sent lately. A batch is padded to its longest text and generates until its
longest answer ends, so what a batch of B costs follows the largest of B sizes: its
median is the quantile 0.5 ** (1 / B) of the sizes (B = 1: the median). An image is
decoded on its own, so its median stands for pixels at any B. A profile of traffic times
each batch size b at the sizes for b (sizes_by_batch): its one label (ProfileSettings.sizes,
the sizes for its plan's load batch) names the shape, and its figure for b is what a
padded batch of b of that traffic costs.

Until a kind has min_requests, it is left out and the profile uses the task's sample.
A distribution whose representative size moved by more than a factor `threshold`
from the one a profile was made for has shifted (shifted()): the profile no longer
describes the traffic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from packrat.types import Profile, profile_sizes
from packrat.worker_counters import SizeHistogram

MIN_REQUESTS = 20  # fewer requests of a kind than this: not yet a distribution
PADDED_KINDS = ("tokens", "generated")  # a batch costs what its largest request does
SHIFT_FACTOR = 1.5  # a representative size this many times larger or smaller: shifted


def representative_sizes(histograms: Mapping[str, SizeHistogram], batch: int = 1,
                         min_requests: int = MIN_REQUESTS) -> tuple[tuple[str, int], ...]:
    """(kind, size) to profile a load batch of `batch` with, for each kind with traffic."""
    out = []
    for kind, hist in sorted(histograms.items()):
        if hist.requests < min_requests:
            continue
        q = 0.5 ** (1 / max(1, batch)) if kind in PADDED_KINDS else 0.5
        size = hist.quantile(q)
        if size is not None:
            out.append((kind, max(1, round(size))))
    return tuple(out)


def sizes_by_batch(histograms: Mapping[str, SizeHistogram], batches: Iterable[int],
                   label: Iterable[tuple[str, int]] = (),
                   min_requests: int = MIN_REQUESTS) -> tuple[tuple[int, tuple[tuple[str, int], ...]], ...]:
    """(batch, sizes) for each of `batches` whose representative sizes differ from `label`
    (the sizes a profile is labelled with: those of its plan's load batch): a profile times
    batch b at the largest of b requests' sizes, as a served batch of b is padded, so every
    batch's figure is for what a batch of that size costs (ProfileSettings.sizes_by_batch).
    (): no kind has traffic, or every batch's sizes are the label's."""
    label = tuple(sorted(label))
    out = []
    for b in sorted(set(batches)):
        here = representative_sizes(histograms, b, min_requests)
        if here and here != label:
            out.append((b, here))
    return tuple(out)


def shifted(profiled: Mapping[str, int], now: Mapping[str, int], factor: float = SHIFT_FACTOR) -> list[str]:
    """The kinds whose representative size moved by more than `factor` either way since
    `profiled` (a kind profiled with the task's sample, now with traffic, counts too)."""
    out = []
    for kind, size in sorted(now.items()):
        before = profiled.get(kind)
        if before is None or max(size, before) > factor * max(1, min(size, before)):
            out.append(kind)
    return out


def timed_sizes(profile: Profile | None) -> dict[str, int]:
    """The request size per kind a profile was timed at (its settings' "sizes"). {}: not
    known: a profile made before profiles recorded their sample's sizes, or one of an
    archive whose task cannot count them; shifted() then takes every kind of traffic as
    moved (the caller bounds how often that re-measures)."""
    return dict(profile_sizes(profile))  # what a plan made from it says its predictions are for


RECENT_S = 30.0  # the traffic "now": what the workers served over about this long


class RecentSizes:
    """What a model's workers served lately, from their cumulative size histograms.

    A worker's histogram counts every request since it started, so after minutes of short
    texts an hour of long ones barely moves its median: the shape it says is the past's.
    update() is handed each reading ({worker pid: {kind: histogram}}) with its time and
    returns what was served since the newest earlier reading at least `window_s` old (a
    worker not in it counts from its start; until a reading is that old, everything since
    the workers started). A worker read since then but gone now (a swap retired its
    version) still counts what it had served by its last reading: the traffic did not
    change because other processes serve it. Pure: the caller reads the counters and the
    clock."""

    def __init__(self, window_s: float = RECENT_S) -> None:
        self.window_s = window_s
        self._readings: dict[str, list[tuple[float, dict[int, dict[str, SizeHistogram]]]]] = {}

    def update(self, model: str, now: float,
               reading: Mapping[int, Mapping[str, SizeHistogram]]) -> dict[str, SizeHistogram]:
        kept = self._readings.setdefault(model, [])
        old = [r for r in kept if now - r[0] >= self.window_s]
        base = old[-1][1] if old else {}
        kept[:] = ([old[-1]] if old else []) + [r for r in kept if now - r[0] < self.window_s]
        kept.append((now, {pid: dict(sizes) for pid, sizes in reading.items()}))
        latest: dict[int, dict[str, SizeHistogram]] = {}
        for _, workers in kept[1 if old else 0:]:  # the readings since base, oldest first
            latest.update(workers)
        out: dict[str, SizeHistogram] = {}
        for pid, sizes in latest.items():
            for kind, hist in sizes.items():
                before = base.get(pid, {}).get(kind)
                since = hist - before if before is not None else hist
                out[kind] = out[kind] + since if kind in out else since
        return out

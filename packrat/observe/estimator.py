"""Estimate the live batch B of a model from its counters: a pure function.

    estimate(state, observation, settings) -> (Estimate, new_state)

B is the number of requests in the server at once. By Little's law the
time-average number of requests in a system equals the total time they spent
in it divided by the wall time: over a window,

    concurrency = Δ ts_inference_latency_microseconds / Δ wall time

(the latency counter runs from arrival to response, queue included; see
metrics.py). Closed-loop clients that each keep one request outstanding give
concurrency ≈ number of clients, which is the B the paper plans for.

Why counters and not the describe API's `pendingRequests`: that is a
snapshot of queued jobs only (not the batches workers are running), so one
reading says little; the counters integrate every request over the window.
`pendingRequests` is used only to tell "idle" from "every request is slower
than the window".

Smoothing follows the paper: an EWMA of the per-tick concurrency, rounded to
a power of two (profiles are taken at powers of two), then the mode of the
last k rounded values, here a strict majority (see `majority`), so one noisy
window cannot move B and a ramp does not drag it through every level.

A clear step does not wait for the majority. When `step_windows` (2)
consecutive windows each read a concurrency at least `step_ratio` (2x)
above, or at most 1/step_ratio of, the smoothed B, in the same direction,
the step is taken at once: the window restarts at the last sample before
the first of them (where the step began), B becomes that post-step
window's concurrency rounded, and the EWMA and the votes are set to it.
A 1 -> 8 client step reads 8 two ticks after the step (it took seven),
and a model whose load went away (8 -> 0) reads idle on the post-step
window four ticks after (it took five) instead of waiting for its old load
to leave a whole window. A spike shorter than the window moves it less than
2x and leaves B to the majority, as before (tests/data/observe/spike.jsonl).
The jump is taken only when it changes B: a load already at B = 1 does
not jump to idle, so a sparse load's gaps between requests are not steps.

Quiet time. Each estimate carries `active_s`, when the load last showed
(Estimate.quiet_s is the time since): the sample's time when requests are
pending, or arrived and none was answered; the previous mark when the
counters stood still; else, by Little's law within the tick, the tick's
start plus Δ latency / the load's concurrency (the EWMA), at most the
sample's time. So a load that stopped 0.3 s into a tick reads quiet from
there, not from the sample (ticks of 1-2 s on a busy machine would add
that much to every reading), while a load that went on reads 0. The window
integrates the last 5 s, so it reads a load for seconds after it stopped;
quiet_s says within a tick or two that it stopped, which is what the
division of cores among models asks (packrat.control.division: cores are
split only between models whose loads overlap in time).

The caller owns the state (a frozen value) and the clock (the observation's
time_s); nothing here reads time or talks to TorchServe.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

from packrat.observe.metrics import window_means
from packrat.types import Estimate, Observation


@dataclass(frozen=True)
class EstimatorSettings:
    # Little's-law window. Well above one request's latency (the latency
    # counter grows only when a request finishes, in one lump), but short:
    # after a load step the window's value ramps linearly for window_s, and
    # a long ramp walks the estimate through intermediate powers of two.
    # 5 s: with 1 s ticks a step from 1 to 8 clients reads as 8 after ~7 s.
    window_s: float = 5.0
    # Weight of the newest window in the EWMA (paper: an EWMA).
    alpha: float = 0.5
    # B moves to a value only when it is the majority of this many rounded
    # estimates (ticks, 1 s each in the controller); else the previous B holds.
    mode_k: int = 5
    # The window stretches to this many mean request latencies when requests
    # are slow: a request's whole latency lands in the window it finishes in,
    # so a backlog of multi-second requests finishing inside a short window
    # overstates the concurrency (seen with MiniLM on a busy machine: 2
    # clients read as 13 right after a step down from 8). Capped at max_window_s.
    latency_windows: float = 4.0
    max_window_s: float = 60.0
    # First estimate only once the window spans at least this much time.
    min_span_s: float = 1.0
    # Clamp of the estimate; plans beyond the profile make no sense.
    max_batch: int = 1024
    # Step detector: a window this many times above or below the smoothed B...
    step_ratio: float = 2.0
    # ...this many windows in a row (same direction) moves B at once (module doc).
    step_windows: int = 2


@dataclass(frozen=True)
class EstimatorState:
    # Observations inside the window, oldest first (the oldest is the base).
    samples: tuple[Observation, ...] = ()
    ewma: float | None = None
    recent: tuple[int, ...] = ()  # last mode_k rounded estimates
    batch: int = 1  # current smoothed estimate
    resets: int = 0  # counter resets seen (TorchServe restarts)
    voted: bool = False  # a majority has formed at least once (batch comes from data)
    latency_ms: float | None = None  # last known mean request latency (sizes the window)
    # A step in progress: its direction (+1 up, -1 down, 0 none), how many windows in a row
    # departed that way, and the last sample before the first of them (where it began).
    step_dir: int = 0
    step_count: int = 0
    step_base: Observation | None = None
    # The newest sample that showed load (module doc, "Quiet time"); None: none seen yet.
    active_s: float | None = None


def round_pow2(x: float, max_batch: int = 1024) -> int:
    """Nearest power of two in log scale (3 -> 4, 5 -> 4, 6 -> 8), at least 1."""
    if x <= 1.0:
        return 1
    p = 2 ** round(math.log2(x))
    return int(min(max(p, 1), max_batch))


def _majority_value(values: tuple[int, ...], k: int) -> int | None:
    if not values:
        return None
    value, count = Counter(values).most_common(1)[0]
    return value if count > k / 2 else None


def majority(values: tuple[int, ...], k: int, previous: int) -> int:
    """The value held by more than half of the last k values, else `previous`.

    The paper takes the mode of the last few estimates. A plain mode (ties to
    the newest) follows a ramp step by step: 1 -> 2 -> 4 -> 8 after a jump
    from 1 to 8 clients, and each step could cost a swap. Asking for a
    majority of k holds the old value until the new one is clearly there.
    """
    value = _majority_value(values, k)
    return previous if value is None else value


def window_for(latency_ms: float | None, settings: EstimatorSettings) -> float:
    """window_s, or latency_windows mean latencies if that is longer (capped)."""
    if latency_ms is None:
        return settings.window_s
    stretched = settings.latency_windows * latency_ms / 1000.0
    return min(max(settings.window_s, stretched), max(settings.max_window_s, settings.window_s))


def _went_backwards(prev: Observation, obs: Observation) -> bool:
    if obs.requests_total < prev.requests_total or obs.latency_us_total < prev.latency_us_total:
        return True
    q0, q1 = prev.queue_latency_us_total, obs.queue_latency_us_total
    return q0 is not None and q1 is not None and q1 < q0


@dataclass(frozen=True)
class _Window:
    """What the counters say between two samples."""

    span_s: float
    concurrency: float  # Little's law: Δ latency / Δ wall time
    requests: float
    mean_latency_ms: float | None
    mean_queue_ms: float | None
    idle: bool  # no request arrived or finished, none pending


def last_active(state: EstimatorState, obs: Observation) -> float:
    """When the load last showed, as of `obs` (module doc, "Quiet time")."""
    prev = state.samples[-1] if state.samples else None
    if prev is None or state.active_s is None or obs.pending_requests:
        return obs.time_s  # nothing known of the time before, or requests waiting now
    d_req = obs.requests_total - prev.requests_total
    d_lat = obs.latency_us_total - prev.latency_us_total
    if d_req == 0 and d_lat == 0:
        return state.active_s
    if d_lat <= 0:
        return obs.time_s  # requests arrived and none was answered: they are in the server now
    # Little's law over the tick: the answered requests spent d_lat in the server, which a
    # load at its concurrency c (the EWMA as last read) fills in d_lat / c seconds from the
    # tick's start. A load that stopped early in the tick is placed where it stopped, not at
    # the sample; a load that went on fills the tick (clamped to the sample's time).
    c = max(state.ewma or 1.0, 1.0)
    return min(obs.time_s, prev.time_s + d_lat / 1e6 / c)


def _measure(base: Observation, obs: Observation) -> _Window:
    span = obs.time_s - base.time_s
    w = window_means(base, obs)
    idle = w.requests == 0 and w.latency_us == 0 and not obs.pending_requests
    return _Window(span, w.latency_us / 1e6 / span, w.requests, w.mean_latency_ms, w.mean_queue_ms, idle)


def departs(concurrency: float, batch: int, ratio: float) -> int:
    """+1 if `concurrency` is at least `ratio` times `batch`, -1 if at most 1/ratio of it, else 0."""
    if concurrency >= ratio * batch:
        return 1
    if concurrency * ratio <= batch:
        return -1
    return 0


def _pending_step(state: EstimatorState, samples: tuple[Observation, ...], concurrency: float,
                  settings: EstimatorSettings) -> tuple[int, int, Observation | None]:
    """(direction, windows in a row, where it began) of the step this window is part of."""
    # Before the first majority B is the prior 1, not a measurement to step away from.
    direction = departs(concurrency, state.batch, settings.step_ratio) if state.voted else 0
    if direction == 0:
        return 0, 0, None
    if direction == state.step_dir and state.step_base is not None:
        return direction, state.step_count + 1, state.step_base
    return direction, 1, samples[-2]  # the step began after the previous tick's sample


def _jump(state: EstimatorState, samples: tuple[Observation, ...], obs: Observation,
          base: Observation, settings: EstimatorSettings) -> tuple[Estimate, EstimatorState] | None:
    """B moved to the post-step window's value at once, or None when that would not change B."""
    post = _measure(base, obs)
    rounded = round_pow2(post.concurrency, settings.max_batch)
    if rounded == state.batch:
        return None
    kept = (base,) + tuple(s for s in samples if s.time_s > base.time_s)
    est = Estimate(
        time_s=obs.time_s, model=obs.model, batch=rounded, ready=True,
        concurrency=post.concurrency, ewma=post.concurrency, rounded=rounded,
        request_rate=post.requests / post.span_s, mean_latency_ms=post.mean_latency_ms,
        mean_queue_ms=post.mean_queue_ms, span_s=post.span_s, idle=post.idle, step=True,
        active_s=state.active_s,
    )
    latency = post.mean_latency_ms if post.mean_latency_ms is not None else state.latency_ms
    return est, replace(state, samples=kept, ewma=post.concurrency,
                        recent=(rounded,) * settings.mode_k, batch=rounded, voted=True,
                        latency_ms=latency, step_dir=0, step_count=0, step_base=None)


def estimate(
    state: EstimatorState,
    obs: Observation,
    settings: EstimatorSettings = EstimatorSettings(),
) -> tuple[Estimate, EstimatorState]:
    """Fold one observation into the estimate. Pure: same inputs, same outputs."""
    hold = Estimate(time_s=obs.time_s, model=obs.model, batch=state.batch, ready=False,
                    ewma=state.ewma, active_s=state.active_s)
    if state.samples:
        last = state.samples[-1]
        if obs.time_s <= last.time_s:
            # A stale or repeated reading: nothing to learn, nothing changes.
            return hold, state
        if _went_backwards(last, obs):
            # TorchServe restarted (or a series vanished): counters restarted
            # from zero, so a delta across this point is meaningless. Start a
            # new window here; keep the smoothed estimate, which is still the
            # best guess of the load.
            new = replace(state, samples=(obs,), resets=state.resets + 1,
                          step_dir=0, step_count=0, step_base=None, active_s=obs.time_s)
            return replace(hold, reset=True, active_s=obs.time_s), new
    state = replace(state, active_s=last_active(state, obs))
    hold = replace(hold, active_s=state.active_s)

    # Keep the newest sample at or before (now - window) as the base, so the
    # window spans at least the window once enough history exists.
    samples = state.samples + (obs,)
    horizon = obs.time_s - window_for(state.latency_ms, settings)
    while len(samples) >= 2 and samples[1].time_s <= horizon:
        samples = samples[1:]
    if len(samples) < 2 or obs.time_s - samples[0].time_s < settings.min_span_s:
        return hold, replace(state, samples=samples)

    w = _measure(samples[0], obs)
    direction, count, step_base = _pending_step(state, samples, w.concurrency, settings)
    if count >= settings.step_windows and step_base is not None:
        jumped = _jump(state, samples, obs, step_base, settings)
        if jumped is not None:
            return jumped
        direction, count, step_base = 0, 0, None  # no change of B: watch afresh

    # An idle window feeds 0 into the EWMA: the estimate decays towards 1 and
    # stays there (round_pow2 clamps at 1); the policy refuses to swap on idle.
    ewma = w.concurrency if state.ewma is None else (
        settings.alpha * w.concurrency + (1.0 - settings.alpha) * state.ewma)
    rounded = round_pow2(ewma, settings.max_batch)
    recent = (state.recent + (rounded,))[-settings.mode_k:]
    batch = majority(recent, settings.mode_k, state.batch)
    # Until a first majority forms, `batch` is the prior (1), not a measurement.
    voted = state.voted or _majority_value(recent, settings.mode_k) is not None

    est = Estimate(
        time_s=obs.time_s, model=obs.model, batch=batch, ready=voted,
        concurrency=w.concurrency, ewma=ewma, rounded=rounded,
        request_rate=w.requests / w.span_s, mean_latency_ms=w.mean_latency_ms,
        mean_queue_ms=w.mean_queue_ms, span_s=w.span_s, idle=w.idle, active_s=state.active_s,
    )
    latency = w.mean_latency_ms if w.mean_latency_ms is not None else state.latency_ms
    return est, replace(state, samples=samples, ewma=ewma, recent=recent, batch=batch,
                        voted=voted, latency_ms=latency,
                        step_dir=direction, step_count=count, step_base=step_base)

"""Whether to swap to the plan for the estimated B: a pure decision function.

    decide(state, context) -> (Decision, new_state)

After Ray Serve's autoscaling policy: the caller (packrat.control) owns and
persists the state and injects the clock (`context.now_s`); nothing here reads
time, talks to TorchServe or keeps hidden state, so a restarted controller
resumes from the persisted state and tests drive ticks by calling decide().

Rules, in order (the first that applies gives the reason):
  disabled            the model is pinned to a fixed plan (REST switch)
  swap-in-progress    never start a swap while one runs
  warming-up          the estimator has no full window yet
  idle                no traffic: B says nothing about the next load
  no-plan             no candidate plan for the estimated B
  cores-moved         the active plan's workers run outside the cores the model
                      now has (packrat.plan.share: cores divided among models)
                      -> swap to the best plan on its cores, once B has held
                      min_stable_s and the cores have been elsewhere for
                      min_stable_s too (else "cores-settling": when load moves
                      from one model to another, the new one's first ticks
                      split the cores while the old one's load is still in its
                      window; a tick or two later the old one reads quiet, idle
                      for the division (packrat.control.division), and needs no
                      move; so load alternating every few seconds moves nothing);
                      neither dwell nor the gain threshold apply
  no-active-plan      nothing applied yet -> swap (the initial plan), once B
                      has held min_stable_s
  no-prediction       the active plan cannot be scored at this B
  same-plan           the best plan for B is the one running
  estimate-settling   B changed less than the hold for this gain ago (a short
                      spike and its queue drain can move a 5 s window for a
                      few seconds: recorded in tests/data/observe/spike.jsonl):
                        hold = fast_stable_s (0.9 s) if gain >= fast_gain (0.5, 1.5x),
                                 B took its value at a step (Estimate.step: the
                                 estimator's step detector, two windows 2x off B)
                                 and the raw window still reads B
                        hold = min_stable_s (5 s)   otherwise
                      A clear step moves B by the step detector, which
                      restarts the window where the step began, so the window
                      reads the new B from then on; the recorded spike moves B
                      by the majority (its drain keeps a 5 s window at 3.3 for
                      4 s: not 2x off B = 2). So a 1 -> 8 step with a 1.9x plan
                      is decided the tick after B moves (3.5-4.0 s after the
                      step on the recorded trace, not 7.5-8.0), while a 1.2x
                      plan, a B the majority moved, or one the window no longer
                      reads waits 5 s. (A burst that doubles the window for two
                      ticks and still fills it a tick later passes for a step.)
  gain-below-threshold  predicted gain ≤ gain_threshold
  dwell               the last swap was less than the dwell for this gain ago:
                        dwell(gain) = min_dwell_s · min(1, (gain_threshold / gain) ** dwell_power)
                      min_dwell_s at the threshold, a quarter of it at twice the
                      threshold; with the defaults (60 s, 0.10, 2) a 1.5x faster
                      plan (gain 0.5) waits 2.4 s, a 2.7x one 0.2 s, a 1.2x one 15 s
  gain                -> swap
  swap-rate           any swap above (cores-moved, no-active-plan, gain) is held
                      while max_swaps_per_window swaps were ordered in the last
                      swap_window_s (2 in 120 s: one a minute on average, two
                      at once): the hard bound that keeps alternating load from
                      making swap storms, whatever the gains say

"B has held" counts from the tick the ready estimate last changed, idle
counting as a value of its own: a model that gets load after being idle
starts its clock then, so it is not moved for the idle prior B = 1 before
the estimator (its step detector) has read the new load.

Gain is a speedup minus one: L_active(B) / L_candidate(B) - 1, both
predicted at the estimated B (0.10 = the candidate is 1.1x faster).

Contention. Profiles time one instance alone; instances side by side are
slower (memory bandwidth, caches; the paper saw 12-15 %). Once a plan has run
for settle_s at the load it was planned for (the raw window, the EWMA and the
smoothed B all read the plan's batch), the policy compares the observed
mean service time (TorchServe's latency minus its queue time, per request)
with the plan's prediction and keeps, per model,

    factor(n) = base · (1 + per_corunner · (n - 1))      n = workers in a plan

`base` (EWMA of observed/predicted for one-worker plans) absorbs what every
plan shares (HTTP, serialisation, queueing); `per_corunner` (EWMA of the
excess per extra co-running worker, measured on plans with n ≥ 2) is the
contention. Candidates are compared with corrected latencies, so a large
per_corunner can make the policy prefer fewer, fatter workers, or not swap at
all; Decision.correction_changed_choice says when that happened and
Decision.latency_gap reports observed/predicted - 1 of the active plan.

A gap that cannot be told apart must not change the choice. A multi-worker
plan's gap is shared overhead plus contention, in unknown parts; base is a
factor of every plan, so it cancels in every comparison and gain. Hence:
  - until a one-worker plan has been observed, a multi-worker ratio is folded
    into base (pooled_samples counts them); the first one-worker ratio
    replaces such a base (it carried the co-runners' contention);
  - per_corunner is learned, and used, only against a trusted base
    (base_samples >= min_correction_samples one-worker ticks); between the
    first one-worker tick and then, multi-worker ratios teach nothing.
Before this rule the whole gap was booked as contention against base = 1 (or a
one-tick base), and a serving overhead shared by all plans made 2 workers
look 1.5x slower than profiled: the policy swapped to one fat worker the
profile predicted 25 % slower (docs/benchmarks/step-two-sleep.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from packrat.observe.estimator import round_pow2
from packrat.plan.candidates import same_shape
from packrat.types import Correction, Decision, Estimate, Plan

# Correction, Decision and Estimate are packrat.types values (the controller, the REST API
# and the bench read them); a decision's wire format is Decision.to_dict / from_dict.


@dataclass(frozen=True)
class PolicySettings:
    # Swap only if the candidate is predicted this much faster (0.10 = 1.1x).
    gain_threshold: float = 0.10
    # No new swap sooner than this after the last one (a swap costs seconds of
    # 2-3x latency; the paper's own admitted cost), so noise cannot flap plans,
    # for a gain at the threshold; a larger gain waits less (dwell_power).
    min_dwell_s: float = 60.0
    # The dwell shrinks as (gain_threshold / gain) ** dwell_power: a large
    # predicted gain pays for the swap's cost soon, and waiting costs it. 0:
    # every swap waits min_dwell_s.
    dwell_power: float = 2.0
    # The hard bound on swaps of one model: at most max_swaps_per_window in any
    # swap_window_s (2 in 120 s: one a minute on average, a burst of two).
    swap_window_s: float = 120.0
    max_swaps_per_window: int = 2
    # The estimated B must have held this long before a swap to its plan...
    min_stable_s: float = 5.0
    # ...or only fast_stable_s for a gain swap of at least fast_gain when B came from
    # the estimator's step detector and the raw window still reads it (module doc,
    # estimate-settling): 4 s more of a large gain lost after a clear step cost more
    # than a swap, and a spike moves B by the majority. fast_gain = inf: off.
    # 0.9 s: the next 1 s tick confirms B, though it comes a few ms early.
    fast_gain: float = 0.5
    fast_stable_s: float = 0.9
    # Observed latency is trusted for the correction only this long after the
    # active plan came in (warm-up, queues left over from the swap).
    settle_s: float = 15.0
    # A window teaches the correction only with at least this many requests.
    min_requests: float = 10.0
    # EWMA weight of each new observed/predicted ratio. Slow on purpose:
    # co-run contention is a property of a plan's shape, while a burst of
    # other work on the machine is transient and should not move it much.
    correction_alpha: float = 0.1
    # A part of the correction (base, per co-runner) is used for choosing only
    # once this many settled ticks have measured it.
    min_correction_samples: int = 10
    # per_corunner is kept within this range: beyond it the "contention" is
    # more likely other work on the machine than co-running workers (the
    # paper saw 12-15 % in total on 16 cores).
    per_corunner_range: tuple[float, float] = (-0.25, 0.5)
    # Ratios outside [1/max_ratio, max_ratio] are clamped: a stall or a
    # mis-profiled point should not throw the correction arbitrarily far.
    max_ratio: float = 4.0
    # Use the correction when choosing (it is always measured and reported).
    use_correction: bool = True


IDLE = 0  # PolicyState.seen_batch of an idle estimate (B is at least 1)


@dataclass(frozen=True)
class PolicyState:
    last_swap_s: float | None = None
    swaps: int = 0
    correction: Correction = field(default_factory=Correction)
    seen_batch: int | None = None  # the estimated B of the last ready tick, IDLE when idle
    seen_since_s: float | None = None  # since when it has had that value
    seen_step: bool = False  # it took that value at a step (Estimate.step)
    swap_times: tuple[float, ...] = ()  # swaps ordered within the last swap_window_s
    misplaced_since_s: float | None = None  # since when the plan runs outside the model's cores


@dataclass(frozen=True)
class PolicyContext:
    now_s: float  # the caller's clock
    model: str
    estimate: Estimate
    current: Plan | None  # the active plan (None: nothing applied yet)
    # The active plan's predicted latency at estimate.batch
    # (packrat.plan.plan_latency_at); None if it cannot be scored.
    current_latency_ms: float | None
    # Realisable plans for estimate.batch, the optimiser's choice first
    # (packrat.plan.realizable_plan, then e.g. predict.uniform_candidates).
    candidates: tuple[Plan, ...]
    enabled: bool = True
    swap_in_progress: bool = False
    # When the active plan finished swapping in (None: unknown, e.g. it was
    # there before the controller started). Dwell and settle count from the
    # later of this and the last swap this policy ordered.
    active_since_s: float | None = None
    # The active plan's workers run on cores the model no longer has (the
    # division of cores among models moved): it must move, whatever the gain.
    misplaced: bool = False
    # The observed latency may teach the correction: the traffic is of the input shape the
    # predictions are for (packrat.observe.loop.shape_rules); False: only reported.
    learn: bool = True
    settings: PolicySettings = field(default_factory=PolicySettings)


def _since(state: PolicyState, ctx: PolicyContext) -> float | None:
    marks = [t for t in (state.last_swap_s, ctx.active_since_s) if t is not None]
    return max(marks) if marks else None


def update_correction(corr: Correction, ratio: float, workers: int,
                      settings: PolicySettings) -> Correction:
    """Fold one observed/predicted ratio of a `workers`-worker plan into the correction
    (module doc, "Contention"): a gap is booked as contention only against a base
    measured on one-worker plans."""
    r = min(max(ratio, 1.0 / settings.max_ratio), settings.max_ratio)
    a = settings.correction_alpha
    trusted = corr.base_samples >= settings.min_correction_samples
    if workers <= 1:
        # The first one-worker ratio replaces a pooled base: that one carried co-runners.
        base = r if corr.base_samples == 0 else a * r + (1 - a) * corr.base
        out = replace(corr, base=base, base_samples=corr.base_samples + 1, pooled_samples=0,
                      last_ratio=r)
        if not trusted and out.base_samples >= settings.min_correction_samples:
            # per_corunner learned against an unmeasured base (a state written before
            # this rule) would book shared overhead as contention: start it afresh.
            out = replace(out, per_corunner=0.0, corunner_samples=0)
        return out
    if corr.base_samples == 0:
        # No one-worker plan seen: overhead and contention cannot be told apart, so the
        # gap goes to base, which every plan shares and so cannot change a choice.
        base = r if corr.pooled_samples == 0 else a * r + (1 - a) * corr.base
        return replace(corr, base=base, pooled_samples=corr.pooled_samples + 1, last_ratio=r)
    if not trusted:
        # A base from a few one-worker ticks is too young to measure contention against
        # (step-two-sleep: one tick gave 0.44, and 1.5x became 0.5 per co-runner), and
        # co-runners' ratios folded into it would hide the contention later.
        return replace(corr, last_ratio=r)
    # Excess per co-runner implied by this plan, given what one worker alone shows.
    per = (r / corr.base - 1.0) / (workers - 1)
    pc = per if corr.corunner_samples == 0 else a * per + (1 - a) * corr.per_corunner
    lo, hi = settings.per_corunner_range
    pc = min(max(pc, lo), hi)
    return replace(corr, per_corunner=pc, corunner_samples=corr.corunner_samples + 1,
                   last_ratio=r)


def required_dwell_s(gain: float | None, settings: PolicySettings) -> float:
    """The dwell before a swap with this corrected gain (module doc): min_dwell_s at the
    threshold, shrinking as (gain_threshold / gain) ** dwell_power above it."""
    if gain is None or settings.gain_threshold <= 0 or gain <= settings.gain_threshold:
        return settings.min_dwell_s  # no positive threshold to scale against
    return settings.min_dwell_s * min(1.0, (settings.gain_threshold / gain) ** settings.dwell_power)


def required_stable_s(gain: float | None, clear_step: bool, settings: PolicySettings) -> float:
    """How long B must have held before a gain swap (module doc, estimate-settling):
    fast_stable_s for a large gain after a clear step, else min_stable_s."""
    if clear_step and gain is not None and gain >= settings.fast_gain:
        return min(settings.fast_stable_s, settings.min_stable_s)
    return settings.min_stable_s


def _clear_step(est: Estimate, seen_step: bool) -> bool:
    """B came from the step detector and the raw window still reads it."""
    return (seen_step and not est.idle and est.concurrency is not None
            and round_pow2(est.concurrency) == est.batch)


def _held(state: PolicyState, ctx: PolicyContext) -> tuple[int | None, float | None, float, bool]:
    """(value, since when, seconds held, whether it came at a step) of the ready estimate;
    idle is a value of its own."""
    est = ctx.estimate
    seen_batch, seen_since, seen_step = state.seen_batch, state.seen_since_s, state.seen_step
    value = IDLE if est.idle else est.batch
    if est.ready and value != seen_batch:
        seen_batch, seen_since, seen_step = value, ctx.now_s, est.step
    held = ctx.now_s - seen_since if seen_since is not None else 0.0
    return seen_batch, seen_since, held, seen_step


def _misplaced_since(state: PolicyState, ctx: PolicyContext) -> float | None:
    """Since when the active plan has run outside the model's cores (None: it does not)."""
    if not ctx.misplaced:
        return None
    return state.misplaced_since_s if state.misplaced_since_s is not None else ctx.now_s


def _learn(corr: Correction, ctx: PolicyContext,
           since: float | None) -> tuple[Correction, float | None, float | None]:
    """Learn the contention gap from the active plan, once settled at its own load:
    (correction, observed/predicted - 1 or None, observed ms)."""
    s, est, cur = ctx.settings, ctx.estimate, ctx.current
    settled = since is None or ctx.now_s - since >= s.settle_s
    # "At its own load" means now, not just the smoothed B: right after a load
    # step the estimate still reads the old B for seconds while the latency
    # already reflects the new load. So the raw window and the EWMA must agree too.
    steady = (est.batch == cur.batch and est.rounded == cur.batch
              and est.concurrency is not None
              and round_pow2(est.concurrency) == cur.batch) if cur is not None else False
    # Compare service time (latency minus time queued for a free worker) when
    # TorchServe reports queue time: the profile times one instance working,
    # and how long requests wait for an instance depends on arrivals, not on
    # how fast instances run side by side.
    observed = est.mean_service_ms if est.mean_service_ms is not None else est.mean_latency_ms
    enough = (est.request_rate or 0.0) * (est.span_s or 0.0) >= s.min_requests
    # The live plan as the profiles planned from now predict it (at its own B: steady), not the
    # figure stored when it was applied: a re-profile (another input shape) changes the former
    # without a swap, and a gap against the stale figure taught a 4x wrong correction
    # (docs/benchmarks/traffic-shape-bert-base-epyc-4.md: 1,057 ms stored, 62 ms re-profiled).
    predicted = ctx.current_latency_ms or (cur.predicted_latency_ms if cur is not None else None)
    if (cur is None or ctx.swap_in_progress or not est.ready or est.idle or observed is None
            or observed <= 0 or not (steady and settled and enough) or not predicted or predicted <= 0):
        return corr, None, observed
    ratio = observed / predicted
    if not ctx.learn:
        return corr, ratio - 1.0, observed  # the gap of another input shape: reported, not learnt
    return update_correction(corr, ratio, len(cur.instances), s), ratio - 1.0, observed


@dataclass(frozen=True)
class _Scores:
    """The optimiser's choice as profiled, and the best candidate once corrected."""

    raw: Plan | None  # candidates[0]
    chosen: Plan | None  # the corrected choice
    cur_ms: float | None
    raw_ms: float | None
    gain: float | None
    ccur_ms: float | None
    cch_ms: float | None
    cgain: float | None
    changed: bool  # the correction changed the choice or whether to swap


def _score(ctx: PolicyContext, corr: Correction) -> _Scores:
    s, cur = ctx.settings, ctx.current

    def f(plan: Plan) -> float:
        return corr.factor(len(plan.instances), s.min_correction_samples) if s.use_correction else 1.0

    raw = ctx.candidates[0] if ctx.candidates else None
    chosen = (min(ctx.candidates, key=lambda p: p.predicted_latency_ms * f(p))
              if ctx.candidates else None)
    cur_ms = ctx.current_latency_ms
    raw_ms = raw.predicted_latency_ms if raw is not None else None
    gain = cur_ms / raw_ms - 1.0 if (cur_ms and raw_ms) else None
    ccur_ms = cur_ms * f(cur) if (cur_ms is not None and cur is not None) else None
    cch_ms = chosen.predicted_latency_ms * f(chosen) if chosen is not None else None
    cgain = ccur_ms / cch_ms - 1.0 if (ccur_ms and cch_ms) else None

    def would_swap(g: float | None, target: Plan | None) -> bool:
        return g is not None and g > s.gain_threshold and not same_shape(cur, target)

    changed = (would_swap(gain, raw) != would_swap(cgain, chosen)
               or (would_swap(gain, raw) and not same_shape(raw, chosen)))
    return _Scores(raw, chosen, cur_ms, raw_ms, gain, ccur_ms, cch_ms, cgain, changed)


def _rule(ctx: PolicyContext, sc: _Scores, stable_for: float, moved_for: float,
          since: float | None, clear_step: bool) -> tuple[bool, str]:
    """(swap, reason): the module doc's rules up to "gain", first match wins."""
    s, est, cur = ctx.settings, ctx.estimate, ctx.current
    settling = stable_for < s.min_stable_s
    if not ctx.enabled:
        return False, "disabled"
    if ctx.swap_in_progress:
        return False, "swap-in-progress"
    if not est.ready:
        return False, "warming-up"
    if est.idle:
        return False, "idle"
    if sc.chosen is None:
        return False, "no-plan"
    if cur is None or ctx.misplaced:
        # The first plan, too, waits for B to hold: the first majority can
        # form while the window still covers the quiet time before the load.
        if settling:
            return False, "estimate-settling"
        if cur is not None and moved_for < s.min_stable_s:
            return False, "cores-settling"
        return True, "no-active-plan" if cur is None else "cores-moved"
    if sc.cur_ms is None:
        return False, "no-prediction"
    if same_shape(cur, sc.chosen):
        return False, "same-plan"
    if stable_for < required_stable_s(sc.cgain, clear_step, s):
        return False, "estimate-settling"
    if sc.cgain is None or sc.cgain <= s.gain_threshold:
        return False, "gain-below-threshold"
    if since is not None and ctx.now_s - since < required_dwell_s(sc.cgain, s):
        return False, "dwell"
    return True, "gain"


def decide(state: PolicyState, ctx: PolicyContext) -> tuple[Decision, PolicyState]:
    """One tick of the re-plan decision. Pure."""
    s, est, cur = ctx.settings, ctx.estimate, ctx.current
    since = _since(state, ctx)
    seen_batch, seen_since, stable_for, seen_step = _held(state, ctx)
    corr, gap, observed = _learn(state.correction, ctx, since)
    sc = _score(ctx, corr)
    misplaced_since = _misplaced_since(state, ctx)
    moved_for = ctx.now_s - misplaced_since if misplaced_since is not None else 0.0
    swap, reason = _rule(ctx, sc, stable_for, moved_for, since, _clear_step(est, seen_step))
    recent = tuple(t for t in state.swap_times if ctx.now_s - t < s.swap_window_s)
    if swap and len(recent) >= s.max_swaps_per_window:
        swap, reason = False, "swap-rate"

    decision = Decision(
        time_s=ctx.now_s, model=ctx.model, swap=swap, reason=reason,
        estimated_batch=est.batch, active_batch=cur.batch if cur else None,
        target=sc.chosen if swap else None, optimiser_choice=sc.raw,
        current_ms=sc.cur_ms, candidate_ms=sc.raw_ms, predicted_gain=sc.gain,
        corrected_current_ms=sc.ccur_ms, corrected_candidate_ms=sc.cch_ms, corrected_gain=sc.cgain,
        correction_changed_choice=sc.changed, observed_ms=observed,
        latency_gap=gap, correction=corr, estimate=est, estimate_stable_s=stable_for,
        dwell_s=required_dwell_s(sc.cgain, s) if sc.cgain is not None else None,
    )
    new_state = replace(state, correction=corr, seen_batch=seen_batch, seen_since_s=seen_since,
                        seen_step=seen_step, swap_times=recent, misplaced_since_s=misplaced_since)
    if swap:
        new_state = replace(new_state, last_swap_s=ctx.now_s, swaps=state.swaps + 1,
                            swap_times=recent + (ctx.now_s,))
    return decision, new_state

"""Step-load benchmark (issue 32 item 2): how fast the controller answers a load step.

Scenarios (per model, the closed-loop clients of each phase; every phase lasts phase_s):

* one: one model, 1 -> 8 -> 1 -> 8 clients;
* two: two models, the load (8 clients) moving from the first to the second and back;
* alternate: two models, the 8 clients moving from one to the other every phase (issue 32's
  "every 5 s for 5 minutes": phase_s 5, duration 300 s).

run() serves them as users run Packrat: a private TorchServe (loopback, token auth),
the controller's own tick loop with the default AdaptiveLoop, each model starting on the
plan for its first phase. It returns the trace (clients' requests, level changes, the
decision log, swaps.jsonl); analyse() reads only that trace:

* first swap live: when the first swap landing in the phase started serving;
* right plan live: the plan live at the phase's end is the one the controller settled on
  for that load; it went live when the last swap landing in the phase set its version
  default (swaps.jsonl: started_at + create + register + ready + set_default), or at the
  step itself (0 s) when no swap landed in the phase. None while a swap of the phase is
  still running (or failed) at the phase's end: the controller had not settled.
* throughput: answered requests (HTTP 200) the clients counted in the first 10 / 30 / 60 s
  after the step, per second, against the settled figure: the same over the phase's last
  settled_s (at most half the phase).
* swaps started in the phase, swaps that failed, requests that failed.

The alternate scenario is read per model over the whole load (alternate_rows):

* swaps started while the load ran: in total, per minute (total / the load's minutes), and the
  most in any sliding 60 s window [t, t + 60) (and in 120 s, the policy's hard bound); the
  decision-log reasons of the swaps the policy asked for;
* its share: the cores packrat.plan.share.divide_cores (the controller's division, with the
  controller's own predictor of the model's latency on c cores) gives it when it is the only
  model with clients, at B = its clients (8); "all" when both have clients. Computed at run
  time from the profiles the controller holds (run: trace["shares"]);
* while it had clients: seconds its live plan (the last applied swap serving, swaps.jsonl's
  plan["cores"]) had each core count, and the seconds that count was below its share; the same
  against the cores the controller's division gave it then (sampled every 0.25 s,
  trace["division"]), and the seconds the live plan had fewer cores than that division: to
  tell the estimator's lag (the division's) from a swap held back or still running (the plan's);
* requests sent while it had clients, answered per second, and failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packrat import settings as packrat_settings
from packrat.bench.adapt_rig import Rig, sleep_table, table_profile
from packrat.bench.loadgen import Step, StepLoad
from packrat.bench.machine import describe_machine
from packrat.bench.sleepmodel import SLEEP_MODEL, copy_sleep_model
from packrat.control.division import predictor
from packrat.observe.loop import AdaptSettings
from packrat.plan import realizable_plan
from packrat.plan.share import Demand, divide_cores
from packrat.profile import load_profile
from packrat.server import RunningServer
from packrat.types import Profile

SCENARIOS: dict[str, list[list[int]]] = {
    "one": [[1, 8, 1, 8]],
    "two": [[8, 0, 8], [0, 8, 0]],
}
WINDOWS_S = (10, 30, 60)
ALTERNATE_PHASE_S, ALTERNATE_DURATION_S = 5.0, 300.0  # issue 32: every 5 s for 5 minutes
ALTERNATE_CLIENTS = 8
SWAP_WINDOWS_S = (60, 120)  # the target (1 a minute) and the policy's bound (2 in 120 s)
LIVE_PHASES = ("create", "register", "ready", "set_default")  # until the new version serves


@dataclass(frozen=True)
class ModelSpec:
    name: str
    base: Path  # a model directory, copied into the private store
    profile: Profile
    kind: str  # "sleep" (the table-latency model) or "archive"
    body: bytes = b"x"


def scenario_levels(scenario: str, phase_s: float, duration_s: float = ALTERNATE_DURATION_S) -> list[list[int]]:
    """Each model's clients per phase; alternate: round(duration_s / phase_s) phases, the
    first model loaded in the even ones, the second in the odd ones."""
    if scenario != "alternate":
        return SCENARIOS[scenario]
    first = [ALTERNATE_CLIENTS if k % 2 == 0 else 0 for k in range(max(2, round(duration_s / phase_s)))]
    return [first, [ALTERNATE_CLIENTS - c for c in first]]


def sleep_models(n: int) -> list[ModelSpec]:
    """n copies of the table-latency sleep model, its profile that same table."""
    profile = table_profile("sleepy", sleep_table(SLEEP_MODEL))
    return [ModelSpec(name, SLEEP_MODEL, profile, "sleep") for name in ("sleepy", "sleepy-b")[:n]]


def archive_models(dirs: list[Path], profiles: list[Path], bodies: list[bytes]) -> list[ModelSpec]:
    """Real archives (the directory's name is the model's) with profiles measured here."""
    return [ModelSpec(d.name, d, load_profile(p), "archive", b) for d, p, b in zip(dirs, profiles, bodies)]


@contextlib.contextmanager
def _private_slot_dir(path: Path) -> Iterator[None]:
    """Workers and controller share a slot dir of their own, not the machine's default."""
    env = packrat_settings.get("slot_dir").env
    old = os.environ.get(env)
    os.environ[env] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = old


def _add_model(rig: Rig, spec: ModelSpec) -> None:
    if spec.kind == "sleep":
        copy_sleep_model(rig.store, spec.name)
    else:
        shutil.copytree(spec.base, rig.store / spec.name, symlinks=True)
    rig.register(spec.name, 1)
    from packrat.profile.store import save_profile

    save_profile(spec.profile, rig.controller.profile_path(spec.name))


def loaded_shares(controller: Any, cores: tuple[int, ...], names: list[str], batch: int) -> dict:
    """Cores the division gives each model loaded at B = `batch`: alone (the others idle) and
    all loaded; the controller's own predictor over the profiles it holds (module doc)."""
    def demand(m: str, loaded: bool) -> Demand:
        pred = predictor((), controller.profile_path(m), batch) if loaded else None
        return Demand(m, batch if loaded else None, pred)

    every = divide_cores([demand(m, True) for m in names], cores)
    alone = {m: len(divide_cores([demand(o, o == m) for o in names], cores).cores_of(m)) for m in names}
    return {"batch": batch, "alone": alone, "all": {m: len(every.cores_of(m)) for m in names}}


@contextlib.contextmanager
def _division_samples(controller: Any, names: list[str], every_s: float = 0.25) -> Iterator[list]:
    """[time, {model: cores the division gives it now}] every `every_s` while the block runs."""
    out: list = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            out.append([round(time.time(), 3), {m: len(controller.share_of(m)) for m in names}])

    t = threading.Thread(target=sample, daemon=True, name="division-sampler")
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join(5)


def run(models: list[ModelSpec], levels: list[list[int]], phase_s: float,
        adapt: AdaptSettings | None = None, command: str = "", server: RunningServer | None = None) -> dict:
    """Serve the phases and return the trace (module doc); nothing is judged here.

    `server`: a TorchServe already running to serve them on (the rig attaches: its models
    are added to that server's store and removed again, the server left running); None:
    a private one, started and stopped here."""
    adapt = adapt or AdaptSettings()
    started, load_start = time.time(), os.getloadavg()[0]
    # Attached, the controller reads the slot directory the server's workers write.
    with tempfile.TemporaryDirectory(prefix="packrat-step-") as tmp, _private_slot_dir(
            server.slot_dir if server is not None and server.slot_dir else Path(tmp) / "slots"):
        first = models[0]
        rig = Rig(store=Path(tmp) / "store", workdir=Path(tmp), model=first.name, base_dir=first.base,
                  profile=first.profile, settings=adapt, server=server)
        with rig:
            for spec in models[1:]:
                _add_model(rig, spec)
            for spec, lv in zip(models, levels):
                rig.controller.apply(spec.name, realizable_plan(spec.profile, len(rig.cores), max(lv[0], 1)))
            names = [spec.name for spec in models]
            shares = loaded_shares(rig.controller, rig.cores, names, max(max(lv) for lv in levels))
            rig.start_loop()
            loads = {spec.name: StepLoad(f"{rig.server.inference_url}/predictions/{spec.name}",
                                         [Step(c, phase_s) for c in lv], headers=rig.server.inference_headers,
                                         body=spec.body, clock=time.time)
                     for spec, lv in zip(models, levels)}
            with _division_samples(rig.controller, names) as division:
                for ld in loads.values():
                    ld.start()
                records = {m: ld.join(timeout_s=phase_s * len(levels[0]) + 120) for m, ld in loads.items()}
            time.sleep(1.0)
            swaps = rig.controller.history(None, last=100_000)
            decisions = [d for d in rig.decision_log if "reason" in d]
    machine = describe_machine()
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "command": command or " ".join(sys.argv),
        "machine": {"cpu": machine.label, "cores": len(rig.cores), "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg()[0]},
        "models": [{"name": s.name, "kind": s.kind, "dir": s.base.name,
                    "fingerprint": asdict(s.profile.fingerprint) if s.profile.fingerprint else None}
                   for s in models],
        "phase_s": phase_s,
        "levels": {s.name: lv for s, lv in zip(models, levels)},
        "settings": {"estimator": asdict(adapt.estimator), "policy": asdict(adapt.policy),
                     "tick_s": rig.tick_s},
        "level_changes": {m: [[round(t, 4), c] for t, c in ld.level_changes] for m, ld in loads.items()},
        "requests": {m: [[round(r.start_s, 4), round(r.end_s, 4), r.status] for r in recs]
                     for m, recs in records.items()},
        "decisions": decisions,
        "swaps": swaps,
        "shares": shares,
        "division": division,
    }


# -- reading the trace -------------------------------------------------------------------


def live_at(swap: dict) -> float:
    """When a swap's new version started serving (its default set)."""
    return swap["started_at"] + sum(swap["phases_s"].get(k, 0.0) for k in LIVE_PHASES)


def _rate(ends: list[float], a: float, b: float) -> float:
    return sum(1 for e in ends if a <= e < b) / (b - a)


def _shape(swap: dict) -> list[list[int]]:
    return [[i["threads"], i["batch"]] for i in swap["plan"]["instances"]]


def phase_row(model: str, phase: int, clients: int, t0: float, t1: float, tr: dict,
              settled_s: float) -> dict:
    """One model's figures for one phase [t0, t1) of the trace (module doc)."""
    reqs = tr["requests"][model]
    ok_ends = [e for s, e, st in reqs if st == 200]
    swaps = [s for s in tr["swaps"] if s["model"] == model]
    started = [s for s in swaps if t0 <= s["started_at"] < t1]
    landed = [s for s in swaps if s["outcome"] == "applied" and t0 <= live_at(s) < t1]
    unsettled = [s for s in started if s["outcome"] != "applied" or live_at(s) >= t1]
    before = [s for s in swaps if s["outcome"] == "applied" and live_at(s) < t0]
    plan_at_end = landed[-1] if landed else (before[-1] if before else None)
    decisions = [d for d in tr["decisions"] if d["model"] == model and t0 <= d["time_s"] < t1]
    decided = next((d["time_s"] - t0 for d in decisions if d["swap"]), None)
    n = min(settled_s, (t1 - t0) / 2)
    settled = _rate(ok_ends, t1 - n, t1)
    row: dict = {
        "model": model, "phase": phase, "clients": clients, "duration_s": round(t1 - t0, 1),
        "swap_decided_after_s": None if decided is None else round(decided, 1),
        "first_swap_live_after_s": round(live_at(landed[0]) - t0, 1) if landed else None,
        "right_plan_live_after_s": (None if unsettled else round(live_at(landed[-1]) - t0, 1)
                                    if landed else 0.0),
        "plan_at_end": None if plan_at_end is None else _shape(plan_at_end),
        "last_reason": decisions[-1]["reason"] if decisions else None,
        "settled_over_s": round(n, 1), "settled_rps": round(settled, 2),
    }
    for w in WINDOWS_S:
        rps = _rate(ok_ends, t0, t0 + w) if t0 + w <= t1 else None
        row[f"first_{w}s_rps"] = None if rps is None else round(rps, 2)
        row[f"first_{w}s_of_settled"] = None if rps is None or settled <= 0 else round(rps / settled, 3)
    row.update({
        "swaps": len(started), "swaps_failed": sum(1 for s in started if s["outcome"] != "applied"),
        "requests": sum(1 for s, _, _ in reqs if t0 <= s < t1),
        "failed": sum(1 for s, _, st in reqs if t0 <= s < t1 and st != 200),
    })
    return row


def analyse(tr: dict, settled_s: float = 30.0) -> list[dict]:
    """Every model's every phase, in the order of the trace's models."""
    rows = []
    for model, changes in tr["level_changes"].items():
        for k, ((t0, clients), (t1, _)) in enumerate(zip(changes, changes[1:])):
            rows.append(phase_row(model, k, clients, t0, t1, tr, settled_s))
    return rows


# -- the alternate scenario, read over the whole load -----------------------------------


def max_in_window(times: list[float], window_s: float) -> int:
    """The most of `times` in any window [t, t + window_s) (a busiest one starts at one of them)."""
    ts = sorted(times)
    return max((bisect_left(ts, t + window_s) - bisect_left(ts, t) for t in ts), default=0)


def _step_at(times: list[float], values: list, t: float, before: object = None) -> object:
    """The value of a step function (values[i] from times[i], times sorted) at t."""
    i = bisect_right(times, t)
    return values[i - 1] if i else before


def seconds_by(cuts: list[float], key: Callable[[float], object]) -> dict:
    """Seconds between the first and last cut, summed by key(t) of each piece between cuts
    (key constant on each piece: the cuts are all its change points); None keys are dropped."""
    cs = sorted(set(cuts))
    out: dict = {}
    for a, b in zip(cs, cs[1:]):
        k = key((a + b) / 2)
        if k is not None:
            out[k] = out.get(k, 0.0) + b - a
    return out


def _loaded_keys(tr: dict, model: str) -> tuple[list[float], Callable[[float], object]]:
    """The cuts and key for seconds_by: (live plan cores, share, division's cores) while
    `model` has clients, else None."""
    clients = {m: ([t for t, _ in ch], [c for _, c in ch]) for m, ch in tr["level_changes"].items()}
    applied = sorted((s for s in tr["swaps"] if s["model"] == model and s["outcome"] == "applied"), key=live_at)
    live_t, live_c = [live_at(s) for s in applied], [s["plan"]["cores"] for s in applied]
    div = tr.get("division", [])
    div_t, div_c = [t for t, _ in div], [d.get(model) for _, d in div]
    shares = tr["shares"]

    def key(t: float) -> object:
        loaded = {m for m, (ts, cs) in clients.items() if _step_at(ts, cs, t, 0)}
        if model not in loaded:
            return None
        share = shares["alone"][model] if loaded == {model} else shares["all"][model]
        return _step_at(live_t, live_c, t), share, _step_at(div_t, div_c, t)

    cuts = [t for ts, _ in clients.values() for t in ts] + live_t + div_t
    return cuts, key


def alternate_row(tr: dict, model: str) -> dict:
    """One model's figures over the whole alternating load (module doc)."""
    a = min(ch[0][0] for ch in tr["level_changes"].values())
    b = max(ch[-1][0] for ch in tr["level_changes"].values())
    cuts, key = _loaded_keys(tr, model)
    spans = seconds_by([a, b] + [t for t in cuts if a < t < b], key)
    loaded_s = sum(spans.values())
    swaps = [s for s in tr["swaps"] if s["model"] == model and a <= s["started_at"] < b]
    asked = [d["reason"] for d in tr["decisions"] if d["model"] == model and d["swap"] and a <= d["time_s"] < b]
    reqs = tr["requests"][model]
    live_cores: dict[str, float] = {}
    for (live, _, _), sec in spans.items():
        live_cores[str(live)] = round(live_cores.get(str(live), 0.0) + sec, 2)
    row = {
        "model": model, "load_s": round(b - a, 1), "loaded_s": round(loaded_s, 1),
        "swaps": len(swaps), "swaps_failed": sum(1 for s in swaps if s["outcome"] != "applied"),
        "swaps_per_min": round(len(swaps) / ((b - a) / 60), 2),
        **{f"max_swaps_{w}s": max_in_window([s["started_at"] for s in swaps], w) for w in SWAP_WINDOWS_S},
        "swap_reasons": dict(Counter(asked)),
        "share_alone": tr["shares"]["alone"][model], "share_all": tr["shares"]["all"][model],
        "live_cores_s": live_cores,
        "below_share_s": round(sum(v for (live, sh, _), v in spans.items() if (live or 0) < sh), 2),
        "division_below_share_s": round(sum(v for (_, sh, d), v in spans.items() if d is not None and d < sh), 2),
        # the plan lagging the controller's own division (a swap held back or still running)
        "below_division_s": round(sum(v for (live, _, d), v in spans.items() if d is not None and (live or 0) < d), 2),
        "answered_rps_loaded": round(sum(1 for _, e, st in reqs if st == 200 and key(e) is not None)
                                     / loaded_s, 2) if loaded_s else None,
        "requests": len(reqs), "failed": sum(1 for _, _, st in reqs if st != 200),
    }
    return row


def alternate_rows(tr: dict) -> list[dict]:
    return [alternate_row(tr, m) for m in tr["level_changes"]]

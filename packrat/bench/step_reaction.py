"""Step-load benchmark (issue 32 item 2): how fast the controller answers a load step.

Scenarios (per model, the closed-loop clients of each phase; every phase lasts phase_s):

* one: one model, 1 -> 8 -> 1 -> 8 clients;
* two: two models, the load (8 clients) moving from the first to the second and back.

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
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from packrat import settings as packrat_settings
from packrat.bench.adapt_rig import Rig, sleep_table, table_profile
from packrat.bench.loadgen import Step, StepLoad
from packrat.bench.machine import describe_machine
from packrat.bench.sleepmodel import SLEEP_MODEL, copy_sleep_model
from packrat.observe.loop import AdaptSettings
from packrat.plan import realizable_plan
from packrat.profile import load_profile
from packrat.types import Profile

SCENARIOS: dict[str, list[list[int]]] = {
    "one": [[1, 8, 1, 8]],
    "two": [[8, 0, 8], [0, 8, 0]],
}
WINDOWS_S = (10, 30, 60)
LIVE_PHASES = ("create", "register", "ready", "set_default")  # until the new version serves


@dataclass(frozen=True)
class ModelSpec:
    name: str
    base: Path  # a model directory, copied into the private store
    profile: Profile
    kind: str  # "sleep" (the table-latency model) or "archive"
    body: bytes = b"x"


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
    rig.server.register(spec.name, 1)
    from packrat.profile.store import save_profile

    save_profile(spec.profile, rig.controller.profile_path(spec.name))


def run(models: list[ModelSpec], levels: list[list[int]], phase_s: float,
        adapt: AdaptSettings | None = None, command: str = "") -> dict:
    """Serve the phases and return the trace (module doc); nothing is judged here."""
    adapt = adapt or AdaptSettings()
    started, load_start = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="packrat-step-") as tmp, _private_slot_dir(Path(tmp) / "slots"):
        first = models[0]
        rig = Rig(store=Path(tmp) / "store", workdir=Path(tmp), model=first.name, base_dir=first.base,
                  profile=first.profile, settings=adapt)
        with rig:
            for spec in models[1:]:
                _add_model(rig, spec)
            for spec, lv in zip(models, levels):
                rig.controller.apply(spec.name, realizable_plan(spec.profile, len(rig.cores), max(lv[0], 1)))
            rig.start_loop()
            loads = {spec.name: StepLoad(f"{rig.server.inference_url}/predictions/{spec.name}",
                                         [Step(c, phase_s) for c in lv], headers=rig.server.inference_headers,
                                         body=spec.body, clock=time.time)
                     for spec, lv in zip(models, levels)}
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
        "machine": {"cpu": machine.cpu, "cores": len(rig.cores), "loadavg_start": load_start,
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

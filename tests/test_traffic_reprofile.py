"""With tuning off (--no-tune), a shift of the traffic's input shape re-profiles the live
mode at the traffic's sizes and re-plans from that profile (packrat.control.tuning.Reprofiler).

The decision is tested on a real Controller over the tiny minilm archive, with traffic
sizes written to real worker counters (as packrat.control.traffic reads them); the whole
path (controller process, profile job, its result) beside a real TorchServe."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from packrat import slots
from packrat.apply.versions import served_mode
from packrat.control import Controller, ControllerSettings
from packrat.profile.shape import timed_sizes as profiled_at
from packrat.control.tuning import Reprofiler, _remeasure
from packrat.control.values import ModelState, WorkerState
from packrat.profile.shape import timed_sizes
from packrat.profile.store import load_profile, save_profile
from packrat.types import Instance, Plan, Profile, ProfilePoint
from packrat.worker_counters import LiveCounters

PLAN = Plan(cores=2, batch=1, instances=(Instance(2, 1, 10.0),), predicted_latency_ms=10.0)
MADE_AT_128 = {"sizes": [["tokens", 128]], "max_batch": 1, "cores": 1, "budget_s": 60.0}


def made_at(settings: dict | None) -> Profile:
    """A profile of minilm whose settings say it timed `settings["sizes"]` (None: no settings)."""
    points = tuple(ProfilePoint(threads=t, batch=1, mean_ms=10.0 / t) for t in (1, 2))
    return Profile(model_id="minilm", points=points, extra={"settings": settings} if settings else {})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_shift_asks_for_a_re_profile_once(tiny_store: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(tmp_path / "slots"))  # where the worker counters go
    for folder in (slots.slot_root(), slots.slot_root() / "workers"):
        slots.secure_dir(folder)
    settings = ControllerSettings(management_url="http://127.0.0.1:9", key_file=None, metrics_url=None,
                                  model_store=tiny_store, state_dir=tmp_path / "state", cores=(0, 1))
    c = Controller(settings)  # nothing reached over HTTP here: why() reads files and counters
    st = ModelState(model="minilm", version="1.0", url="minilm", plan=PLAN,
                    workers=(WorkerState({"pid": 301, "status": "READY"}, None),), other_versions=(),
                    mode=served_mode(tiny_store / "minilm"))
    assert st.mode is not None and c.tuning.key(st) is not None  # a Packrat archive
    clock = Clock()
    r = Reprofiler(c, clock=clock)
    assert r.why(st) is None  # no profile to plan from: nothing to re-plan
    save_profile(made_at(MADE_AT_128), c.profile_path("minilm"))
    assert r.why(st) is None  # no traffic yet
    counters = LiveCounters(slots.worker_counters_path(301))
    counters.add_sizes({"tokens": [6] * 30})
    profile, why = r.why(st)
    assert why == "traffic's input shape moved (tokens 128 -> 6)" and profiled_at(profile) == {"tokens": 128}
    # what the re-profile measures again: the profile's own grid, at most the usable cores
    assert _remeasure(profile, 2) == {"max_batch": 1, "cores": 1, "budget_s": 60.0}
    assert _remeasure(made_at(None), 2) == {"max_batch": 1, "cores": 2, "budget_s": 180.0}

    # a profile whose sizes are not known (made before profiles recorded their sample's): redone
    save_profile(made_at({"max_batch": 1}), c.profile_path("minilm"))
    assert r.why(st)[1] == "input shape profiled at is not known (made before sizes were recorded); traffic's: tokens 6"
    save_profile(made_at({"sizes": [["tokens", 8]]}), c.profile_path("minilm"))
    assert r.why(st) is None  # 6 against 8: within the shift factor
    save_profile(made_at(MADE_AT_128), c.profile_path("minilm"))

    # one try per shift: once a re-profile at 6 tokens was tried (whatever came of it), none
    # within min_gap_s, and after it none while the traffic stays near 6
    r.tried["minilm"] = (clock.now, {"tokens": 6})
    assert r.why(st) is None
    clock.now += r.min_gap_s
    assert r.why(st) is None
    # the traffic moves again, to a shape neither the profile (128) nor the try (6) covers: the
    # Reprofiler reads the traffic of the last RECENT_S (the clock moved on: these 300 alone)
    counters.add_sizes({"tokens": [40] * 300})
    assert r.why(st)[1].startswith("traffic's input shape moved (tokens 128 -> 4")  # ~40 (buckets)
    counters.add_sizes({"tokens": [115] * 3000})  # to 115: the profile planned from covers it
    clock.now += r.recent.window_s
    assert r.why(st) is None
    clock.now += r.recent.window_s
    counters.add_sizes({"tokens": [40] * 300})

    # left alone: a model an operator pinned, and one with a profile or tune job unfinished
    c.pins.pin("minilm", PLAN, st.mode)
    assert r.why(st) is None
    c.pins.unpin("minilm")
    release = threading.Event()
    c.jobs.start("profile", "minilm", lambda: release.wait(60) and {})
    try:
        assert r.why(st) is None
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while c.jobs.unfinished("profile", "minilm") is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert r.why(st) is not None


def _start_profile(base: Path, tokens: int) -> Profile:
    """made_at(MADE_AT_128) timed at `tokens`, usable for the archive at `base` on this machine
    (its content hash, this machine's fingerprint): one a returning shape may be planned from."""
    from packrat.profile import library

    config = library.base_config(base)
    return replace(made_at({**MADE_AT_128, "sizes": [["tokens", tokens]]}), model_id=library.HASHES(base),
                   fingerprint=library.expected_fingerprint(config, served_mode(base)))


@pytest.mark.torchserve
def test_no_tune_re_profiles_at_the_traffic_s_sizes(torchserve, tiny_store: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A controller with --no-tune beside a real TorchServe: minilm's profile was made at its
    longest texts, the traffic sends short texts; the controller re-profiles the live mode at
    the traffic's size by itself, and leaves the re-plan to its re-plan loop. Then long texts
    again: it plans from the start profile, kept for that shape, at once (no second
    re-profile, though its min_gap_s of 300 s has not passed)."""
    from packrat.bench.traffic_shape import phases, sent_sizes
    from packrat.control.traffic import served_sizes
    from packrat.profile.shape import representative_sizes
    from serving_support import ControllerProcess, ensure_registered, predict, worker_pids

    ensure_registered(torchserve, "minilm")
    long_texts = phases(tiny_store / "minilm")["B"][1]  # as many tokens as minilm takes
    longest = sent_sizes(tiny_store / "minilm", long_texts)["tokens"]
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(torchserve.slot_dir))
    for _ in range(25):  # a distribution: at least MIN_REQUESTS requests
        assert predict(torchserve, "minilm", b"a short text").status_code == 200
    st = ModelState(model="minilm", version="1.0", url="minilm", plan=None, other_versions=(),
                    workers=tuple(WorkerState({"pid": p}, None) for p in worker_pids(torchserve, "minilm")))
    expected = representative_sizes(served_sizes(st), 1)  # a plain version: B = 1, the median
    assert expected and expected[0][0] == "tokens" and expected[0][1] < 128 / 1.5
    state = tmp_path / "state"
    save_profile(_start_profile(tiny_store / "minilm", longest), state / "profiles" / "minilm.json")
    # The re-profiler checks every 2 s (10 s by default): the shift is seen sooner, nothing else changes.
    monkeypatch.setenv("PACKRAT_TUNE_CHECK_S", "2")
    ctl = ControllerProcess(torchserve, tiny_store, state, ["--no-tune"], ready_path="/healthz")
    try:
        ctl.start()
        deadline = time.monotonic() + 300  # a hang guard: the profile's own budget is 60 s
        while True:
            found = [j for j in ctl.get("/v1/jobs", params={"model": "minilm"}).json() if j["kind"] == "profile"]
            if found and found[-1]["state"] not in ("queued", "running"):
                break
            assert time.monotonic() < deadline, (found, ctl.log())
            time.sleep(1.0)
        job = found[-1]
        assert job["state"] == "done", job
        assert job["result"]["replan"] == "by the re-plan loop"  # adapt is on
        profile = json.loads(Path(job["result"]["profile_path"]).read_text())
        assert [tuple(pair) for pair in profile["settings"]["sizes"]] == list(expected)
        assert profile["settings"]["max_batch"] == 1 and profile["settings"]["cores"] == 1

        # long texts again, and they go on as traffic does (the short ones are soon older than
        # the Reprofiler's window, or outnumbered). Sent as a burst that then stopped, they
        # could all be served by workers a swap retired between two of its readings.
        live = Path(job["result"]["profile_path"])
        deadline = time.monotonic() + 300  # a hang guard of its own (the re-profile may have used the first)
        k = 0
        while timed_sizes(load_profile(live)) != {"tokens": longest}:
            assert time.monotonic() < deadline, _stuck(ctl, state)
            for _ in range(10 if k < 60 else 2):
                assert predict(torchserve, "minilm", long_texts[k % len(long_texts)]).status_code == 200
                k += 1
            time.sleep(0.5)
        jobs = [j for j in ctl.get("/v1/jobs", params={"model": "minilm"}).json() if j["kind"] == "profile"]
        assert len(jobs) == 1, jobs  # planned from the kept profile: nothing measured again
        # both shapes kept: the start profile (when the short texts came), the re-profile's (now)
        kept = sorted(p.name for p in (state / "profiles" / "minilm" / "shapes").rglob("*.json"))
        assert kept == sorted([f"tokens-{longest}.json", f"tokens-{expected[0][1]}.json"])
        assert requests.get(f"{ctl.url}/healthz", timeout=60).status_code == 200
    finally:
        ctl.kill()


def _stuck(ctl, state: Path) -> str:
    """What the controller knew when the traffic's return was not followed: its jobs, the
    model's status (version, mode, traffic, plan), the kept profiles and its log."""
    status = ctl.get("/v1/models/minilm/status").json()
    seen = {k: status.get(k) for k in ("version", "mode", "plan", "traffic", "predicted_for")}
    kept = sorted(str(p.relative_to(state)) for p in (state / "profiles").rglob("*.json"))
    return (f"jobs: {ctl.get('/v1/jobs', params={'model': 'minilm'}).json()}\nstatus: {seen}\n"
            f"profiles: {kept}\nlog:\n{ctl.log(8000)}")

"""A profile made at the task's own sample records the sample's sizes (issue 32, item 3),
so a profile made before there was traffic is re-profiled when the traffic's input shape
differs from the sample's, and left alone when it does not.

Real profiles (the profiler's pinned workers, the archive's own handler) of the tiny
archives; the decision on a real Controller, the traffic written to real worker counters
(as packrat.control.traffic reads them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from packrat import slots
from packrat.apply.versions import served_mode
from packrat.control import Controller, ControllerSettings
from packrat.profile.shape import timed_sizes as profiled_at
from packrat.control.tuning import Reprofiler
from packrat.control.values import ModelState, WorkerState
from packrat.profile import ProfileSettings, open_archive, run_profile
from packrat.profile.store import load_profile, save_profile
from packrat.types import Profile
from packrat.worker_counters import LiveCounters
from test_handler_task import load
from test_traffic_reprofile import PLAN, Clock

AT_THE_SAMPLE = ProfileSettings(cores=1, max_batch=1, point_budget_s=0.3, corun=False)  # no sizes asked


def _sample_size(archive: Path, kind: str) -> int:
    """The size of the task's own sample as the served worker counts it (Task.served_sizes)."""
    task = load(archive)
    requests = task.sample_requests(1)
    batch, responses = task.serve(requests)
    return task.served_sizes(batch, responses)[kind][0]


def _profile_at_the_sample(archive: Path) -> Profile:
    return run_profile(open_archive(archive), AT_THE_SAMPLE, progress=False)


@pytest.mark.parametrize(("name", "kind"), [("tiny-bert", "tokens"), ("tiny-resnet", "pixels")])
def test_a_profile_at_the_sample_records_the_sample_s_sizes(tiny_store: Path, name: str, kind: str) -> None:
    expected = _sample_size(tiny_store / name, kind)
    if kind == "pixels":
        assert expected == 320 * 240  # the sample JPEG, as sent
    else:  # a text of at most max_length tokens, special tokens included
        assert load(tiny_store / name).max_length - 3 <= expected <= load(tiny_store / name).max_length
    profile = _profile_at_the_sample(tiny_store / name)
    assert profile.extra["settings"]["sizes"] == ((kind, expected),)  # the format of sizes asked for
    assert [p.meta["sizes"] for p in profile.points] == [{kind: expected}]
    assert profiled_at(profile) == {kind: expected}


def test_a_generation_profile_records_the_prompt_and_the_answer(tiny_store: Path) -> None:
    archive = tiny_store / "tiny-gpt2"
    expected = {kind: _sample_size(archive, kind) for kind in ("tokens", "generated")}
    assert profiled_at(_profile_at_the_sample(archive)) == expected
    # asked for a prompt length only: the answer's length timed is recorded beside it
    asked = run_profile(open_archive(archive), ProfileSettings(cores=1, max_batch=1, point_budget_s=0.3,
                                                               corun=False, sizes=(("tokens", 10),)),
                        progress=False)
    assert profiled_at(asked) == {"tokens": 10, "generated": expected["generated"]}


def test_an_archive_that_cannot_count_its_sample_records_no_sizes(tmp_path: Path) -> None:
    from profile_support import make_tiny_archive

    profile = _profile_at_the_sample(make_tiny_archive(tmp_path / "tiny"))
    assert profile.extra["settings"]["sizes"] == () and [p.meta["sizes"] for p in profile.points] == [None]


@pytest.fixture
def controller(tiny_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Controller:
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(tmp_path / "slots"))  # where the worker counters go
    for folder in (slots.slot_root(), slots.slot_root() / "workers"):
        slots.secure_dir(folder)
    return Controller(ControllerSettings(management_url="http://127.0.0.1:9", key_file=None, metrics_url=None,
                                         model_store=tiny_store, state_dir=tmp_path / "state", cores=(0, 1)))


def test_a_profile_made_at_the_sample_is_redone_for_traffic_of_another_shape(
        controller: Controller, tiny_store: Path) -> None:
    c, name = controller, "tiny-bert"
    sample = _sample_size(tiny_store / name, "tokens")  # max_length: 6 tokens is far from it
    assert sample > 1.5 * 6
    # the profile `make run`'s first tune or a plain `packrat profile` makes: no sizes asked
    save_profile(_profile_at_the_sample(tiny_store / name), c.profile_path(name))
    st = ModelState(model=name, version="1.0", url=name, plan=PLAN, other_versions=(),
                    workers=(WorkerState({"pid": 401, "status": "READY"}, None),),
                    mode=served_mode(tiny_store / name))
    r = Reprofiler(c, clock=Clock())
    assert r.why(st) is None  # no traffic yet
    LiveCounters(slots.worker_counters_path(401)).add_sizes({"tokens": [6] * 30})
    profile, why = r.why(st)
    # Before profiles recorded the sample's sizes this was None: a plan predicted for the
    # sample served 6-token traffic for ever.
    assert why == f"traffic's input shape moved (tokens {sample} -> 6)"
    assert profiled_at(profile) == profiled_at(load_profile(c.profile_path(name))) == {"tokens": sample}


def test_traffic_at_the_sample_s_own_size_is_not_re_profiled(controller: Controller, tiny_store: Path) -> None:
    c, name = controller, "tiny-bert"
    sample = _sample_size(tiny_store / name, "tokens")
    save_profile(_profile_at_the_sample(tiny_store / name), c.profile_path(name))
    st = ModelState(model=name, version="1.0", url=name, plan=PLAN, other_versions=(),
                    workers=(WorkerState({"pid": 402, "status": "READY"}, None),),
                    mode=served_mode(tiny_store / name))
    counters = LiveCounters(slots.worker_counters_path(402))
    counters.add_sizes({"tokens": [sample] * 300})
    r = Reprofiler(c, clock=Clock())
    assert r.why(st) is None
    counters.add_sizes({"tokens": [sample * 3 // 4] * 400})  # within the shift factor of it: still none
    assert r.why(st) is None


def test_a_tune_before_traffic_records_the_sample_s_sizes_and_a_shift_retunes(
        tiny_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make run`'s first tune: no traffic yet, so the tune profiles at the task's sample;
    its record says the sample's sizes, and 6-token traffic later tunes again."""
    from packrat.control.traffic import why_retune
    from packrat.tune import Tracker, TuneSettings, load_record, tune_model

    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(tmp_path / "slots"))
    for folder in (slots.slot_root(), slots.slot_root() / "workers"):
        slots.secure_dir(folder)
    sample = _sample_size(tiny_store / "tiny-bert", "tokens")
    settings = TuneSettings(cores=1, batch=1, modes=("fp32-eager",), budget_s=60.0, max_batch=1,
                            point_budget_s=0.3)
    tune_model(tiny_store / "tiny-bert", "bert", tmp_path / "state", settings, Tracker(tmp_path / "state", "bert"))
    record = load_record(tmp_path / "state", "bert")
    assert record is not None and record.detail["sizes"] == {"tokens": sample}
    record = record.updated(state="done")  # as Tuning marks it once its choice is applied
    st = ModelState(model="bert", version="1", url="bert", plan=None, other_versions=(),
                    workers=(WorkerState({"pid": 403, "status": "READY"}, None),))
    counters = LiveCounters(slots.worker_counters_path(403))
    counters.add_sizes({"tokens": [sample] * 30})
    assert why_retune(record, st) is None  # the traffic looks like the sample
    counters.add_sizes({"tokens": [6] * 300})  # the median now 6 (sizes below 16 are counted exactly)
    assert why_retune(record, st) == f"traffic's input shape moved (tokens {sample} -> 6)"

"""A profile per traffic shape, kept (issue 32, item 3): when the traffic moves back to sizes
an earlier profile of the same archive, mode and machine covers, the model is planned from
that one at once (no re-profile, no min_gap_s wait); min_gap_s holds only re-profiles of
shapes never measured. And the traffic's shape is what was served lately, not since the
workers started.

On a real Controller over the tiny minilm archive (its real content hash and this machine's
fingerprint), the traffic written to real worker counters; a fake clock (no sleeping)."""

from __future__ import annotations

from pathlib import Path

import pytest

from packrat import slots
from packrat.apply.versions import served_mode
from packrat.control import Controller, ControllerSettings
from packrat.control.traffic import profile_sizes
from packrat.control.tuning import Reprofiler
from packrat.control.values import ModelState, WorkerState
from packrat.observe.loop import AdaptiveLoop, adapt_settings
from packrat.profile import library
from packrat.profile.shape import RecentSizes, timed_sizes
from packrat.profile.store import load_profile, save_profile
from packrat.types import Profile, ProfilePoint
from packrat.worker_counters import BUCKETS, LiveCounters, SizeHistogram, size_bucket
from test_traffic_reprofile import PLAN, Clock


def _hist(size: int, n: int) -> SizeHistogram:
    counts = [0] * BUCKETS
    counts[size_bucket(size)] = n
    return SizeHistogram(tuple(counts), size * n)


def test_recent_sizes_are_what_was_served_lately() -> None:
    recent = RecentSizes(window_s=30.0)
    short = {"tokens": _hist(6, 3000)}
    assert recent.update("m", 1000.0, {7: short})["tokens"].requests == 3000  # nothing older: since start
    # 40 s later the worker has also served 300 long texts: its own histogram's median is
    # still short; what it served since the reading 40 s ago is the long ones only
    both = {"tokens": short["tokens"] + _hist(128, 300)}
    lately = recent.update("m", 1040.0, {7: both})["tokens"]
    assert both["tokens"].quantile(0.5) < 8 and lately.requests == 300 and lately.quantile(0.5) > 100
    # a worker started since (a swap) counts from its start; one gone since the base reading
    # (1040 s) adds nothing more
    lately = recent.update("m", 1080.0, {9: {"tokens": _hist(6, 50)}})["tokens"]
    assert lately.requests == 50 and lately.quantile(0.5) < 8
    # a swap in the window: worker 9 served 200 long texts and was retired, worker 11 took
    # over with 20; what was served lately still holds worker 9's (make test-random SEED=4242:
    # the live worker alone, 20, was too few to see the traffic had moved, so nothing followed it)
    recent.update("m", 1090.0, {9: {"tokens": _hist(6, 50) + _hist(128, 200)}})
    lately = recent.update("m", 1095.0, {11: {"tokens": _hist(128, 20)}})["tokens"]
    assert lately.requests == 50 + 200 + 20 and lately.quantile(0.5) > 100
    # once the window has passed its last reading, the retired worker is gone from it
    assert recent.update("m", 1130.0, {11: {"tokens": _hist(128, 20)}})["tokens"].requests == 0


def _profile(base: Path, mode: str, tokens: int, ms: float) -> Profile:
    """A profile of minilm usable here (its archive's hash, this machine's fingerprint in
    `mode`), timed at `tokens`; `ms`: its 1-thread, batch-1 figure."""
    config = library.base_config(base)
    points = tuple(ProfilePoint(threads=t, batch=1, mean_ms=ms / t) for t in (1, 2))
    return Profile(model_id=library.HASHES(base), points=points,
                   fingerprint=library.expected_fingerprint(config, mode),
                   extra={"settings": {"sizes": [["tokens", tokens]], "max_batch": 1, "cores": 2,
                                       "budget_s": 60.0}, "created": f"2026-12-05T00:00:{tokens % 60:02d}Z"})


@pytest.fixture
def controller(tiny_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Controller:
    monkeypatch.setenv("PACKRAT_SLOT_DIR", str(tmp_path / "slots"))  # where the worker counters go
    for folder in (slots.slot_root(), slots.slot_root() / "workers"):
        slots.secure_dir(folder)
    settings = ControllerSettings(management_url="http://127.0.0.1:9", key_file=None, metrics_url=None,
                                  model_store=tiny_store, state_dir=tmp_path / "state", cores=(0, 1))
    # with a re-plan loop: it re-plans from the profile on its tick (nothing here calls TorchServe)
    return Controller(settings, policy=AdaptiveLoop(adapt_settings(), emit=[].append))


def test_a_returning_shape_is_planned_from_its_kept_profile_at_once(controller: Controller,
                                                                  tiny_store: Path) -> None:
    c, base = controller, tiny_store / "minilm"
    mode = served_mode(base)
    st = ModelState(model="minilm", version="1.0", url="minilm", plan=PLAN, mode=mode, other_versions=(),
                    workers=(WorkerState({"pid": 501, "status": "READY"}, None),))
    live = library.profile_file(c.planner.state_dir, "minilm", mode)  # the per-mode file planned from
    save_profile(_profile(base, mode, 128, 40.0), live)
    counters, clock = LiveCounters(slots.worker_counters_path(501)), Clock()
    r = Reprofiler(c, clock=clock)
    counters.add_sizes({"tokens": [128] * 30})
    assert r.shift(st) is None  # planned from 128 tokens: nothing to do

    # short texts: a shape never measured, so a re-profile; the 128-token profile is kept first
    clock.now += 60
    counters.add_sizes({"tokens": [6] * 300})
    found = r.shift(st)
    assert found is not None and found.kept is None and found.now == {"tokens": 6}
    assert r.why(st) == (found.profile, "traffic's input shape moved (tokens 128 -> 6)")
    kept = library.keep(found.profile, c.planner.state_dir, "minilm", mode)
    assert kept == library.kept_dir(c.planner.state_dir, "minilm", mode) / "tokens-128.json"
    # (what the re-profile at 6 tokens then writes, and the Reprofiler's record of its try)
    save_profile(_profile(base, mode, 6, 10.0), live)
    r.tried["minilm"] = (clock.now, {"tokens": 6})
    assert r.shift(st) is None

    # back to long texts 60 s later, well within min_gap_s: the kept profile, at once
    clock.now += 60
    counters.add_sizes({"tokens": [128] * 300})
    found = r.shift(st)
    assert found is not None and found.kept is not None and found.kept.path == kept
    assert r.why(st) is None  # not a re-profile
    assert r.reuse("minilm", found) == {"replan": "by the re-plan loop"}
    assert [(m, path) for m, _, path in r.reused] == [("minilm", str(kept))]
    assert r.reused[0][1].startswith("traffic's input shape moved (tokens 6 -> 1")  # ~128 (buckets)
    assert timed_sizes(c.planner.profile(st)) == {"tokens": 128}  # what the planner and the loop read
    assert c.planner.profile(st).points[0].mean_ms == 40.0
    assert r.shift(st) is None and r.started == []

    # short texts again: the 6-token profile was kept when the 128 one came back, so it too
    # is reused (check() keeps the profile planned from before it restores another)
    library.keep(_profile(base, mode, 6, 10.0), c.planner.state_dir, "minilm", mode)
    clock.now += 60
    counters.add_sizes({"tokens": [5] * 300})
    found = r.shift(st)
    assert found is not None and found.kept is not None and found.kept.path.name == "tokens-6.json"

    # a shape never measured (40 tokens) within min_gap_s of the last re-profile: held;
    # after it, a re-profile
    clock.now += 60
    counters.add_sizes({"tokens": [40] * 300})
    assert r.shift(st) is None
    clock.now += r.min_gap_s
    counters.add_sizes({"tokens": [40] * 300})
    found = r.shift(st)
    assert found is not None and found.kept is None and found.why.startswith("traffic's input shape moved (tokens 128 -> 4")


def test_a_kept_profile_of_another_archive_or_mode_is_not_reused(controller: Controller, tiny_store: Path) -> None:
    c, base = controller, tiny_store / "minilm"
    mode = served_mode(base)
    stale = _profile(base, mode, 128, 40.0)
    library.keep(Profile(model_id="sha256:another", points=stale.points, fingerprint=stale.fingerprint,
                         extra=stale.extra), c.planner.state_dir, "minilm", mode)
    assert library.kept_covering(c.planner.state_dir, "minilm", mode, base, {"tokens": 120}) is None
    library.keep(stale, c.planner.state_dir, "minilm", "int8-eager")  # kept under another mode
    assert library.kept_covering(c.planner.state_dir, "minilm", mode, base, {"tokens": 120}) is None
    library.keep(stale, c.planner.state_dir, "minilm", mode)  # replaces the stale one of its shape
    assert [p.name for p in library.kept_dir(c.planner.state_dir, "minilm", mode).iterdir()] == ["tokens-128.json"]
    found = library.kept_covering(c.planner.state_dir, "minilm", mode, base, {"tokens": 120})
    assert found is not None and load_profile(found.path).model_id == stale.model_id
    assert library.kept_covering(c.planner.state_dir, "minilm", mode, base, {"tokens": 60}) is None  # > 1.5x


def test_the_reprofiler_sees_a_shift_the_workers_histograms_hide(controller: Controller, tiny_store: Path) -> None:
    """Minutes of short texts, then long ones: the workers' histograms (since they started)
    still say short; the Reprofiler reads what was served lately."""
    c, base = controller, tiny_store / "minilm"
    mode = served_mode(base)
    st = ModelState(model="minilm", version="1.0", url="minilm", plan=PLAN, mode=mode, other_versions=(),
                    workers=(WorkerState({"pid": 502, "status": "READY"}, None),))
    save_profile(_profile(base, mode, 6, 10.0), library.profile_file(c.planner.state_dir, "minilm", mode))
    counters, clock = LiveCounters(slots.worker_counters_path(502)), Clock()
    r = Reprofiler(c, clock=clock)
    counters.add_sizes({"tokens": [6] * 3000})
    assert r.shift(st) is None
    clock.now += 40
    counters.add_sizes({"tokens": [128] * 300})
    assert profile_sizes(st, 1)[0][1] < 8  # since the workers started: still short
    found = r.shift(st)
    assert found is not None and found.now["tokens"] > 100


def test_each_batch_is_timed_at_the_longest_of_its_requests() -> None:
    """A batch of b texts is padded to its longest: a profile of traffic times batch b at the
    quantile 0.5 ** (1 / b) of the sizes (packrat.profile.shape.sizes_by_batch), so a plan
    of batch 4 is not predicted at the median text (traffic-shape-bert-base-epyc-5: timed at
    5 tokens, served batches of 3-6-token texts padded to 6)."""
    from packrat.profile.shape import representative_sizes, sizes_by_batch

    texts = {"tokens": _hist(4, 100) + _hist(6, 100) + _hist(12, 100)}
    label = representative_sizes(texts, 1)
    assert label == (("tokens", 6),)  # the median
    by_batch = dict(sizes_by_batch(texts, [1, 2, 4, 8], label))
    assert 1 not in by_batch  # the label's own sizes: not repeated
    tokens = [dict(by_batch[b])["tokens"] for b in (2, 4, 8)]
    assert tokens == sorted(tokens) and tokens[0] > 6 and size_bucket(tokens[-1]) == size_bucket(12)
    # labelled at batch 8 instead (the live plan's load batch): batch 1 is the one timed apart
    top = representative_sizes(texts, 8)
    assert dict(sizes_by_batch(texts, [1, 2, 4, 8], top))[1] == label
    # an image is decoded on its own: its median at every batch, nothing timed apart
    images = {"pixels": _hist(224 * 224, 50) + _hist(640 * 480, 60)}
    assert sizes_by_batch(images, [1, 2, 4, 8], representative_sizes(images, 1)) == ()
    assert sizes_by_batch({"tokens": _hist(6, 5)}, [1, 2], ()) == ()  # too few requests: the sample

"""Profiles for the traffic served (issue 32, item 3): representative sizes from the
workers' histograms, a shift beyond a factor, and the tasks' samples made at a size."""

from __future__ import annotations

import pytest

from packrat.profile.shape import representative_sizes, shifted
from packrat.worker_counters import SizeHistogram, size_bucket
from test_handler_task import load
from test_size_histogram import _histogram


def test_a_batch_is_represented_by_the_median_of_its_largest_size() -> None:
    traffic = {"tokens": _histogram({6: 90, 115: 10}), "pixels": _histogram({640 * 480: 30}),
               "generated": _histogram({12: 5})}
    one = dict(representative_sizes(traffic, batch=1))
    assert 6 <= one["tokens"] <= 7  # half the requests are 6 tokens long
    assert size_bucket(one["pixels"]) == size_bucket(640 * 480)
    assert "generated" not in one  # 5 requests: not yet a distribution, the task's sample stays
    eight = dict(representative_sizes(traffic, batch=8))
    # a batch of 8 holds a 115-token text more often than not (1 - 0.9**8 = 57 %): padded to it
    assert 96 <= eight["tokens"] <= 127
    assert eight["pixels"] == one["pixels"]  # images are decoded one by one: no padding
    assert representative_sizes({"tokens": SizeHistogram()}) == ()


def test_a_shift_is_a_factor_either_way() -> None:
    assert shifted({"tokens": 100}, {"tokens": 120}) == []
    assert shifted({"tokens": 100}, {"tokens": 40}) == ["tokens"]
    assert shifted({"tokens": 6}, {"tokens": 115}) == ["tokens"]
    assert shifted({}, {"pixels": 300_000}) == ["pixels"]  # profiled with the sample, now traffic
    assert shifted({"tokens": 1}, {"tokens": 2}) == ["tokens"] and shifted({"tokens": 2}, {"tokens": 3}) == []


def _token_lengths(task, requests) -> list[int]:
    batch = task.preprocess(requests)
    assert not batch.errors, batch.errors
    return [len(batch.items[i] if task.name != "text-generation" else batch.items[i][0]) for i in batch.valid]


def test_text_samples_are_made_at_the_size_asked(tiny_store) -> None:
    task = load(tiny_store / "tiny-bert")
    for tokens in (3, 9, 40):
        lengths = _token_lengths(task, task.sample_requests(2, {"tokens": tokens}))
        assert all(tokens - 3 <= n <= tokens for n in lengths), (tokens, lengths)
    # too long for the model: max_length; another kind: the task's own sample (max_length)
    assert _token_lengths(task, task.sample_requests(1, {"tokens": 10_000})) == \
        _token_lengths(task, task.sample_requests(1, {"pixels": 50}))
    assert task.max_length - 3 <= _token_lengths(task, task.sample_requests(1))[0] <= task.max_length


def test_generation_samples_take_prompt_and_answer_lengths(tiny_store) -> None:
    task = load(tiny_store / "tiny-gpt2")
    requests = task.sample_requests(2, {"tokens": 10, "generated": 4})
    assert all(7 <= n <= 10 for n in _token_lengths(task, requests))
    assert [task.preprocess(requests).items[i][1] for i in (0, 1)] == [4, 4]
    capped = task.sample_requests(1, {"generated": 10_000})
    assert task.preprocess(capped).items[0][1] == task.cap
    assert all(getattr(r, "status", 200) == 200 for r in task.run(requests))


@pytest.mark.parametrize("pixels", [60_000, 640 * 480])
def test_image_samples_have_about_the_pixels_asked(tiny_store, pixels: int) -> None:
    task = load(tiny_store / "tiny-resnet")
    requests = task.sample_requests(1, {"pixels": pixels})
    sent = task.preprocess(requests).items[0][2]  # width x height as sent
    assert abs(sent - pixels) <= pixels * 0.01, (sent, pixels)


def test_a_profile_times_the_sizes_it_is_given(tmp_path, tiny_store) -> None:
    from packrat.profile import ProfileSettings, open_archive, run_profile
    from profile_support import make_tiny_archive

    settings = ProfileSettings(cores=1, max_batch=1, point_budget_s=0.3, corun=False, sizes=(("tokens", 8),))
    profile = run_profile(open_archive(tiny_store / "tiny-bert"), settings, progress=False)
    assert profile.extra["settings"]["sizes"] == (("tokens", 8),)  # the input shape the figures are for
    assert [p.meta["sizes"] for p in profile.points] == [{"tokens": 8}]
    # an archive whose task makes its own sample only: timed as before, and said so
    old = run_profile(open_archive(make_tiny_archive(tmp_path / "tiny")), settings, progress=False)
    assert [p.meta["sizes"] for p in old.points] == [None]

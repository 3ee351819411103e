"""Property-based fuzzing of every task's inputs through a real TorchServe (hypothesis).

Each example sends one fuzzed request (packrat/bench/fuzz.py: arbitrary bytes
and text, arbitrary and deeply nested JSON, JSON with the task's fields,
images of random size/mode/format, damaged images, lying headers, base64 junk,
bodies around the size limit), for batching archives together with three good
requests. The fuzzed one must be answered 200 or a documented 4xx, never a
5xx; the good ones 200; and at the end the model's workers have the pids they
had at the start. Sized for CI (265 examples); scripts/fuzz_inputs.py is the
long campaign (docs/reliability.md).
"""

from __future__ import annotations

from collections import Counter

import pytest
import yaml
import io

from hypothesis import example, find, given, settings
from PIL import Image

from packrat.bench.fuzz import (
    DOCUMENTED, LARGE_FORMATS, LARGE_SIZES, PAD_TARGETS, Fuzz, good_request, image_bytes, large_image, pad_to,
    requests_for,
)
from packrat.bench.handler_code import handler_module
from serving_support import ensure_registered, predict, predict_together, worker_pids

pytestmark = pytest.mark.torchserve

# task -> (archive, good requests sent beside each fuzzed one, examples)
MODELS = {
    "noop": ("noop", 0, 25),
    "text-classification": ("tiny-bert-b4", 3, 60),
    "feature-extraction": ("minilm", 0, 40),
    "text-generation": ("tiny-gpt2", 3, 40),
    "image-classification": ("tiny-resnet", 3, 100),
}


@pytest.fixture(scope="module")
def server(torchserve):
    ensure_registered(torchserve, *(m for m, _, _ in MODELS.values()))
    return torchserve


def _body_limit(store, model: str) -> int:
    """Around where the handler's body limit lies (the size probes aim there)."""
    section = yaml.safe_load((store / model / "model_config.yaml").read_text()).get("packrat") or {}
    if "max_image_bytes" in section:
        return 4 * section["max_image_bytes"] // 3
    return 1 << 20


def _check(fuzz: Fuzz, r) -> None:
    assert r.status_code in DOCUMENTED, f"{fuzz!r} -> {r.status_code} {r.text[:300]}"
    if r.status_code != 200:
        assert r.json()["message"], f"{fuzz!r} -> {r.status_code} without a message: {r.text[:300]}"


@pytest.mark.parametrize("task", list(MODELS))
def test_fuzzed_inputs_get_200_or_a_documented_4xx(server, tiny_store, task) -> None:
    model, companions, examples = MODELS[task]
    good = good_request(task)
    before = worker_pids(server, model)
    statuses: Counter = Counter()

    @settings(max_examples=examples, deadline=None)
    @given(fuzz=requests_for(task, _body_limit(tiny_store, model), max_pixels=200_000))
    # Every run reaches the model at least once, whatever the seed draws (a seed once drew
    # 100 image examples without one readable image).
    @example(fuzz=Fuzz("good", good["body"]))
    def one(fuzz: Fuzz) -> None:
        if companions:
            first, *rest = predict_together(server, model, [fuzz.kwargs()] + [good] * companions)
            assert [r.status_code for r in rest] == [200] * companions, (fuzz, [r.text[:200] for r in rest])
        else:
            first = predict(server, model, **fuzz.kwargs())
        _check(fuzz, first)
        statuses[first.status_code] += 1

    one()
    assert worker_pids(server, model) == before, "a worker was replaced while fuzzing"
    # The model answered as well as refused (guards against a handler that refuses
    # everything; test_image_strategy_draws_readable_images guards the strategy).
    assert statuses[200] > 0, statuses
    if task != "noop":  # noop echoes anything
        assert sum(v for k, v in statuses.items() if k != 200) > 0, statuses


def _readable(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
        return True
    except Exception:
        return False


def test_image_strategy_draws_readable_images() -> None:
    """The image fuzz is not only garbage: it draws undamaged images PIL can read
    (checked without a server, so no seed of the served test can hide a broken strategy)."""
    kind, data = find(image_bytes(200_000), lambda drawn: drawn[0] == "image" and _readable(drawn[1]),
                      settings=settings(max_examples=500, database=None))
    assert kind == "image" and _readable(data)


def test_large_sizes_straddle_the_shipped_image_limits() -> None:
    """The campaign's large images (scripts/fuzz_inputs.py) sit on both sides of each
    default limit of image.py, so a change of a default shows here."""
    image = handler_module("packrat_tasks.image")
    pixels = [w * h for w, h in LARGE_SIZES]
    aspects = [max(w, h) / min(w, h) for w, h in LARGE_SIZES]
    assert image.MAX_IMAGE_PIXELS in pixels and max(pixels) > 2 * image.MAX_IMAGE_PIXELS  # PIL's bomb check too
    assert any(image.MAX_IMAGE_PIXELS - 10_000 < p <= image.MAX_IMAGE_PIXELS and a == image.MAX_ASPECT_RATIO
               for p, a in zip(pixels, aspects))
    assert any(a > image.MAX_ASPECT_RATIO for a in aspects)
    assert image.MAX_DECODED_PIXELS in pixels and image.MAX_DECODED_PIXELS + 2048 in pixels
    assert image.MAX_IMAGE_BYTES in PAD_TARGETS


@pytest.mark.parametrize("fmt", LARGE_FORMATS)
def test_padded_large_images_hit_the_body_limit_and_still_open(fmt: str) -> None:
    for size in (PAD_TARGETS[0] - 64, PAD_TARGETS[0] + 3):
        data = pad_to(large_image(2048, 2048, "L", fmt, "noise"), size)
        assert len(data) == size
        with Image.open(io.BytesIO(data)) as img:
            img.draft(None, (256, 256))
            img.load()
            assert img.format == fmt.split("-")[0] and img.size[0] >= 256

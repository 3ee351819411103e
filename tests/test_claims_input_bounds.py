"""Input bounds at the shipped defaults, through TorchServe (docs/handler.md's limits table).

tests/test_input_bounds.py uses an archive with its limits lowered to 1 megapixel so
each oversized case is a small PNG. Here the archive sets no limit: an image just over
the default pixel limit (25,000,000, read from the header) and one over the default
aspect ratio (20:1) share a batch with two good images; each bad one gets its own
4xx with the message the docs give, and the good ones in the same batch are answered.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import yaml
from PIL import Image

from packrat.archive import ArchiveOptions, build_named
from packrat_tasks.samples import sample_jpeg  # handlers/: on the path (pyproject's pythonpath)
from serving_support import ensure_registered, predict_together

pytestmark = pytest.mark.torchserve

MODEL = "claims-resnet-defaults"
# Four requests make a batch as soon as all four are queued: the delay only bounds how long
# the first one waits for the others (a hang guard; the answers say how they were batched).
BATCH, MAX_DELAY_MS = 4, 20_000
DEFAULT_PIXELS = 25_000_000  # handlers/packrat_tasks/image.py MAX_IMAGE_PIXELS


def _png(width: int, height: int, mode: str = "1") -> bytes:
    # A 1-bit blank image: ~25 megapixels compress to a few KiB, far under every byte limit.
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def _good_jpeg(seed: int) -> bytes:
    return sample_jpeg(320, 240, seed=seed)


@pytest.fixture(scope="module")
def server(torchserve, tiny_store: Path):
    """The session server with an archive at the shipped limits (none set), batching 4."""
    build_named("tiny-resnet", tiny_store, MODEL, ArchiveOptions(batch_size=BATCH, max_batch_delay_ms=MAX_DELAY_MS))
    ensure_registered(torchserve, MODEL)
    try:
        yield torchserve
    finally:
        torchserve.management_client().unregister(MODEL, "1.0")
        shutil.rmtree(tiny_store / MODEL, ignore_errors=True)


def test_oversized_images_at_the_default_limits_fail_alone_in_their_batch(server) -> None:
    side = 5000
    over = (side, DEFAULT_PIXELS // side + 1)  # 5000 x 5001 = 25,005,000 pixels
    bodies = [_png(*over), _good_jpeg(1), _png(2100, 100), _good_jpeg(2)]
    responses = predict_together(server, MODEL, [{"body": b} for b in bodies])
    # One batch: every answer, the refused ones too, carries the size of the batch it was in.
    assert [r.headers.get("x-packrat-batch-size") for r in responses] == [str(BATCH)] * BATCH, \
        [(r.status_code, r.headers.get("x-packrat-batch-size")) for r in responses]
    big, good1, wide, good2 = responses
    assert big.status_code == 413, big.text
    assert big.json()["message"] == (f"image is {over[0]}x{over[1]} = {over[0] * over[1]} pixels; "
                                     f"the limit is {DEFAULT_PIXELS}")
    assert wide.status_code == 400, wide.text
    assert "aspect ratio 21.0:1 exceeds the limit of 20:1" in wide.json()["message"], wide.text
    for good in (good1, good2):
        assert good.status_code == 200, good.text
        assert good.json() and "label" in str(good.json()), good.text


def test_defaults_are_what_the_archive_runs_with(server, tiny_store: Path) -> None:
    section = yaml.safe_load((tiny_store / MODEL / "model_config.yaml").read_text())["packrat"]
    assert not {"max_image_pixels", "max_image_bytes", "max_aspect_ratio", "max_resized_pixels"} & set(section)

"""Every handler input bounded before it costs (issue 14), through a real TorchServe.

Each case sends one bad request in the same batch as three good ones (batching
archives: 4 requests, 300 ms window) and checks: the bad one gets its 4xx and
message (docs/handler.md, "Input limits"), the good ones 200, the batch really
held all four, and the worker kept its pid. Limits are the archives' (tests/
conftest.py): tiny-bert 64 tokens -> 2048 characters; tiny-gpt2 cap 12 new
tokens; tiny-resnet 1,000,000 pixels, 200,000 image bytes, 500,000 resized
pixels, default aspect ratio 20:1.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from packrat.bench.fuzz import png_claiming
from serving_support import ensure_registered, predict_batched, worker_pids

pytestmark = pytest.mark.torchserve

JSON = {"Content-Type": "application/json"}


def _png(w: int, h: int, noise: bool = False) -> bytes:
    buf = io.BytesIO()
    if noise:
        img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
    else:
        img = Image.new("RGB", (w, h), (10, 20, 30))
    img.save(buf, "PNG")
    return buf.getvalue()


def _image(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(buf, fmt)
    return buf.getvalue()


def _nested(depth: int) -> bytes:
    return b'{"text": "hi", "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


B64_LIMIT = 4 * ((200_000 + 2) // 3)  # base64 length of tiny-resnet's 200,000 image bytes

# (input class, archive, bad request, status, words the message must contain)
CASES = [
    # text: body size before decoding (1 MiB), characters before tokenising (32 per token)
    ("body size", "tiny-bert-b4", {"body": b"a " * 600_000}, 413, "body is 1200000 bytes; the limit is 1048576"),
    ("text chars", "tiny-bert-b4", {"body": b"a" * 3000}, 413, "3000 characters long; the limit is 2048"),
    ("text tokens", "tiny-bert-b4", {"body": b"word " * 100}, 413, "at most 64"),
    ("text surrogate", "tiny-bert-b4", {"body": b'{"text": "\\ud800 hi"}', "headers": JSON}, 400, "surrogate"),
    # JSON: nesting depth before parsing (32); the 200 KB body answered 503 for the batch
    ("json depth 200KB", "tiny-bert-b4", {"body": _nested(100_000), "headers": JSON}, 400,
     "JSON nesting depth 100000 exceeds the limit of 32"),
    ("json depth 33", "tiny-bert-b4", {"body": _nested(33)}, 400, "depth 33 exceeds the limit of 32"),
    ("json number", "tiny-bert-b4", {"body": b'{"text": "hi", "n": ' + b"9" * 5000 + b"}", "headers": JSON},
     400, "malformed JSON"),
    # generation: max_new_tokens and prompt length
    ("max_new_tokens", "tiny-gpt2", {"body": b'{"text": "hi", "max_new_tokens": 13}'}, 400, "between 1 and 12"),
    ("max_new_tokens bool", "tiny-gpt2", {"body": b'{"text": "hi", "max_new_tokens": true}'}, 400, "must be int"),
    ("prompt chars", "tiny-gpt2", {"body": b"a" * 3000}, 413, "3000 characters long; the limit is 2048"),
    # images: all from the header, before decoding
    ("decoded pixels", "tiny-resnet", {"body": _png(1100, 1000)}, 413, "1100x1000 = 1100000 pixels"),
    ("decompression bomb", "tiny-resnet", {"body": png_claiming(60_000, 60_000)}, 413,
     "more than twice the limit of 1000000 pixels"),
    ("aspect ratio", "tiny-resnet", {"body": _png(40_000, 5)}, 400, "aspect ratio 8000.0:1 exceeds the limit of 20:1"),
    ("resized pixels", "tiny-resnet", {"body": _png(80, 10)}, 413,
     "resized to 2048x256 = 524288 pixels; the limit is 500000"),
    ("image bytes", "tiny-resnet", {"body": _png(280, 280, noise=True)}, 413, "the limit is 200000"),
    ("format GIF", "tiny-resnet", {"body": _image("GIF")}, 415, "image format GIF is not supported"),
    ("format BMP", "tiny-resnet", {"body": _image("BMP")}, 415, "image format BMP is not supported"),
    ("format WEBP", "tiny-resnet", {"body": _image("WEBP")}, 415, "image format WEBP is not supported"),
    ("not an image", "tiny-resnet", {"body": b"\x00\x01 not an image"}, 400, "not a JPEG or PNG"),
    ("corrupt image", "tiny-resnet", {"body": _png(200, 150, noise=True)[:5000]}, 400, "corrupt"),
    # base64 in JSON: size before decoding, strict decoding
    ("base64 size", "tiny-resnet", {"body": json.dumps({"image": "A" * (B64_LIMIT + 4)}).encode()}, 413,
     f"{B64_LIMIT + 4} base64 characters; the limit is {B64_LIMIT}"),
    ("base64 junk", "tiny-resnet", {"body": b'{"image": "not base64!!"}', "headers": JSON}, 400, "not valid base64"),
    ("base64 data url", "tiny-resnet",
     {"body": json.dumps({"image": "data:image/png;base64," + base64.b64encode(_png(8, 8)).decode()}).encode()},
     400, "not valid base64"),
    ("image body size", "tiny-resnet", {"body": b'{"image": "' + b"A" * 300_000 + b'"}'}, 413, "body is 300013 bytes"),
    ("image json depth", "tiny-resnet", {"body": b'{"image": ' + b"[" * 40 + b"]" * 40 + b"}"}, 400,
     "JSON nesting depth 41 exceeds"),
]
GOOD = {
    "tiny-bert-b4": {"body": b"a perfectly fine input"},
    "tiny-gpt2": {"body": b'{"text": "hello there", "max_new_tokens": 12}'},
    "tiny-resnet": {"body": _png(64, 48, noise=True)},
}


@pytest.fixture(scope="module")
def server(torchserve):
    ensure_registered(torchserve, "tiny-bert-b4", "tiny-gpt2", "tiny-resnet")
    return torchserve


@pytest.mark.parametrize("cls,model,bad,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_alone_in_its_batch(server, cls, model, bad, status, words) -> None:
    before = worker_pids(server, model)
    good = GOOD[model]
    responses = predict_batched(server, model, [good, bad, good, good])
    assert [r.status_code for r in responses] == [200, status, 200, 200], [r.text[:200] for r in responses]
    body = responses[1].json()
    assert body["code"] == status and words in body["message"], body
    assert worker_pids(server, model) == before


def test_json_depth_at_the_limit_is_accepted(server) -> None:
    responses = predict_batched(server, "tiny-bert-b4", [{"body": _nested(32)}] * 2 + [GOOD["tiny-bert-b4"]] * 2)
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]

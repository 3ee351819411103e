"""Bad input: a 4xx with a message for that request only; the worker survives."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from serving_support import ensure_registered, predict, predict_batched, worker_pids

pytestmark = pytest.mark.torchserve


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


# (model, request kwargs, expected status, words the message must contain)
CASES = [
    ("tiny-bert", {"body": b""}, 400, "empty"),
    ("tiny-bert", {"body": b"caf\xe9 \xff\xfe"}, 400, "UTF-8"),
    ("tiny-bert", {"body": b'{"text": "unterminated', "headers": {"Content-Type": "application/json"}},
     400, "malformed JSON"),
    ("tiny-bert", {"body": b'{"text": 42}'}, 400, "field 'text' must be str"),
    ("tiny-bert", {"json": ["a", "list"]}, 400, "JSON object"),
    ("tiny-bert", {"body": ("word " * 200).encode()}, 413, "at most 64"),
    ("tiny-bert", {"body": b"curl -d text", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
     415, "form-encoded"),
    ("tiny-gpt2", {"json": {"text": "hi", "max_new_tokens": 13}}, 400, "between 1 and 12"),
    ("tiny-gpt2", {"json": {"text": "hi", "max_new_tokens": 0}}, 400, "between 1 and 12"),
    ("tiny-gpt2", {"json": {"text": "hi", "max_new_tokens": "5"}}, 400, "must be int"),
    ("tiny-resnet", {"body": b"this is not an image"}, 400, "not a JPEG or PNG"),
    ("tiny-resnet", {"body": _png(1100, 1000)}, 413, "1100x1000"),
    ("tiny-resnet", {"json": {"image": 7}}, 400, "field 'image' must be str"),
]


@pytest.fixture(scope="module")
def server(torchserve):
    ensure_registered(torchserve, "tiny-bert", "tiny-gpt2", "tiny-resnet", "tiny-bert-b4")
    return torchserve


@pytest.mark.parametrize("model,kwargs,status,words", CASES,
                         ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_bad_input_is_refused_and_worker_survives(server, model, kwargs, status, words) -> None:
    before = worker_pids(server, model)
    r = predict(server, model, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == status and words in body["message"], body
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    assert worker_pids(server, model) == before
    # and the worker still serves good requests
    good = predict(server, model, _good_payload(model))
    assert good.status_code == 200, good.text


def _good_payload(model: str) -> bytes:
    if model == "tiny-resnet":
        return _png(64, 48)
    return b"a perfectly fine input"


def test_bad_and_good_requests_in_one_batch(server) -> None:
    before = worker_pids(server, "tiny-bert-b4")
    payloads = [
        {"body": b"first good text"},
        {"body": b"\xff\xfe\xfd"},
        {"body": b"second good text"},
        {"body": b'{"text": }'},
    ]
    responses = predict_batched(server, "tiny-bert-b4", payloads)  # all four in one batch
    assert [r.status_code for r in responses] == [200, 400, 200, 400]
    assert "UTF-8" in responses[1].json()["message"]
    assert "malformed JSON" in responses[3].json()["message"]
    single = predict(server, "tiny-bert-b4", b"first good text").json()
    assert responses[0].json()["label"] == single["label"]
    assert all(abs(responses[0].json()["scores"][k] - single["scores"][k]) < 1e-5 for k in single["scores"])
    assert worker_pids(server, "tiny-bert-b4") == before

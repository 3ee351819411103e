"""Served outputs equal what the models compute directly (real TorchServe, token on)."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from serving_support import ensure_registered, predict, predict_together

pytestmark = pytest.mark.torchserve

TEXTS = [
    "Packrat runs thin workers.",
    "A much longer sentence about CPU inference servers, batching, cores and latency percentiles.",
]


@pytest.fixture(scope="module")
def server(torchserve):
    ensure_registered(torchserve, "minilm", "tiny-gpt2", "tiny-resnet", "tiny-resnet-ts",
                      "tiny-bert", "tiny-bert-ts")
    return torchserve


def _direct_minilm(text: str) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    from packrat.archive.local_tokenizers import minilm_dir

    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    model = AutoModel.from_pretrained(str(minilm_dir())).eval()
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state[0]
    mean = hidden.mean(dim=0).numpy()  # one text: every token is real
    return mean / np.linalg.norm(mean)


def test_minilm_embedding_equals_direct_transformers(server) -> None:
    for text in TEXTS:
        r = predict(server, "minilm", text.encode())
        assert r.status_code == 200, r.text
        served = np.array(r.json()["embedding"])
        assert served.shape == (384,)
        direct = _direct_minilm(text)
        cosine = float(served @ direct / (np.linalg.norm(served) * np.linalg.norm(direct)))
        assert cosine >= 0.9999, cosine
        assert abs(np.linalg.norm(served) - 1.0) < 1e-4


def test_responses_are_compact_json_with_their_content_type(server) -> None:
    # The handler encodes its JSON itself (json's C encoder, no indent): TorchServe's own
    # json.dumps(indent=2) ran the pure-Python encoder, 11 % of a served MiniLM worker's time.
    for model, payload in (("minilm", TEXTS[1].encode()), ("tiny-bert", b"a short review")):
        r = predict(server, model, payload)
        assert r.status_code == 200, r.text
        assert r.headers.get("content-type", "").startswith("application/json"), r.headers
        assert b"\n" not in r.content and b", " not in r.content and b": " not in r.content, r.content[:200]
        assert r.json()
    # What a task already gave as bytes stays as it is (the no-op echo).
    ensure_registered(server, "noop")
    echo = predict(server, "noop", b"[1, 2]")
    assert echo.content == b"[1, 2]" and not echo.headers.get("content-type", "").startswith("application/json")


def test_minilm_json_input_and_batch_padding_agree(server) -> None:
    raw = predict(server, "minilm", TEXTS[0].encode()).json()["embedding"]
    as_json = predict(server, "minilm", json={"text": TEXTS[0]}).json()["embedding"]
    assert np.allclose(raw, as_json, atol=1e-6)


def _direct_generate(server, prompt: str, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(server.model_store / "tiny-gpt2" / "model")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, enc.input_ids.shape[1]:].tolist()


def test_tiny_gpt2_greedy_equals_generate_also_when_batched(server) -> None:
    cases = [("Hello", 5), ("The servers answered thousands of requests about the weather", 9),
             ("a b c", 12)]
    single = predict(server, "tiny-gpt2", json={"text": cases[0][0], "max_new_tokens": cases[0][1]})
    assert single.status_code == 200, single.text
    assert single.json()["token_ids"] == _direct_generate(server, *cases[0])

    responses = predict_together(
        server, "tiny-gpt2", [{"json": {"text": p, "max_new_tokens": n}} for p, n in cases]
    )
    batch_sizes = [int(r.headers["x-packrat-batch-size"]) for r in responses]
    for (prompt, n), r in zip(cases, responses):
        assert r.status_code == 200, r.text
        body = r.json()
        expected = _direct_generate(server, prompt, n)
        assert body["token_ids"] == expected
        assert len(body["token_ids"]) <= n
    # Prompts of different lengths did share a batch (left padding was exercised).
    assert max(batch_sizes) > 1, batch_sizes


def _jpeg(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("model", ["tiny-resnet", "tiny-resnet-ts"])
def test_resnet_top_k(server, model) -> None:
    r = predict(server, model, _jpeg(300, 260, 1))
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert len(preds) == 3  # tiny-resnet's top_k
    probs = [p["probability"] for p in preds]
    assert probs == sorted(probs, reverse=True)
    assert all(0 <= p <= 1 for p in probs) and sum(probs) <= 1 + 1e-6
    assert len({p["label"] for p in preds}) == 3

    r2 = predict(server, model, json={"image": base64.b64encode(_jpeg(300, 260, 1)).decode(), "top_k": 10})
    preds10 = r2.json()["predictions"]
    assert len(preds10) == 10
    assert math.isclose(sum(p["probability"] for p in preds10), 1.0, rel_tol=1e-4)  # all 10 classes
    assert preds10[:3] == preds


def test_torchscript_runtime_matches_eager(server) -> None:
    # tiny-bert and tiny-bert-ts share architecture and seed: same weights, other runtime.
    for text in TEXTS:
        eager = predict(server, "tiny-bert", text.encode()).json()["scores"]
        graph = predict(server, "tiny-bert-ts", text.encode()).json()["scores"]
        assert eager.keys() == graph.keys()
        assert all(abs(eager[k] - graph[k]) < 1e-4 for k in eager)

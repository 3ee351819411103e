"""Every installed execution mode serves through a real TorchServe (token auth on),
agrees with fp32 eager, and a mode that fails the accuracy guard never serves.

One server for the module; tiny seeded models (the same seed gives every mode
archive the same weights, so the fp32-eager archive is the reference).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import requests

from packrat.server import start_torchserve
from serving_support import ensure_registered, predict, predict_together

pytestmark = pytest.mark.torchserve

HAVE_ORT = importlib.util.find_spec("onnxruntime") is not None
HAVE_OV = importlib.util.find_spec("openvino") is not None
HAVE_ONNX = importlib.util.find_spec("onnx") is not None


def _bf16_ok() -> bool:
    import torch

    flags = open("/proc/cpuinfo").read()
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


BF16 = _bf16_ok()

# (archive name, architecture, precision, runtime, needs)
TEXT_MODES = [
    ("bert-fp32-eager", "fp32", "eager", True),
    ("bert-bf16-torchscript", "bf16", "torchscript", BF16),
    ("bert-int8-torchscript", "int8", "torchscript", True),
    ("bert-fp32-onnxruntime", "fp32", "onnxruntime", HAVE_ORT and HAVE_ONNX),
    ("bert-bf16-openvino", "bf16", "openvino", HAVE_OV and HAVE_ONNX and BF16),
    ("bert-int8-openvino", "int8", "openvino", HAVE_OV and HAVE_ONNX and HAVE_ORT),
]
# torch.compile takes ~50 s for a tiny model on 2 free cores: registered alone, after the rest.
INDUCTOR = ("bert-fp32-inductor", "fp32", "inductor", True)
IMAGE_MODES = [
    ("resnet-fp32-eager", "fp32", "eager", True),
    ("resnet-bf16-torchscript", "bf16", "torchscript", BF16),
    ("resnet-fp32-openvino", "fp32", "openvino", HAVE_OV and HAVE_ONNX),
]
GEN_MODES = [
    ("gpt2-fp32-eager", "fp32", "eager", True),
    ("gpt2-bf16-eager", "bf16", "eager", BF16),
]
# int8 differs from fp32 by ~1e-4 in probability here; 0 tolerance must refuse it.
STRICT = {"max_prob_diff": 0.0}


def _installed(modes):
    return [m for m in modes if m[3]]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    from packrat.archive import ArchiveOptions, build_named

    store = tmp_path_factory.mktemp("modes-store")
    batching = dict(batch_size=4, max_batch_delay_ms=200)
    for name, precision, runtime, _ in _installed(TEXT_MODES) + [INDUCTOR]:
        build_named("tiny-bert", store, name, ArchiveOptions(precision=precision, runtime=runtime, **batching))
    for name, precision, runtime, _ in _installed(IMAGE_MODES):
        build_named("tiny-resnet", store, name, ArchiveOptions(precision=precision, runtime=runtime, **batching))
    for name, precision, runtime, _ in _installed(GEN_MODES):
        build_named("tiny-gpt2", store, name, ArchiveOptions(precision=precision, runtime=runtime,
                                                             max_new_tokens_cap=8, **batching))
    build_named("tiny-bert", store, "bert-int8-strict",
                ArchiveOptions(precision="int8", runtime="torchscript", extra={"guard": STRICT}))
    return store


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    server = start_torchserve(store, tmp_path_factory.mktemp("modes-ts"))
    try:
        yield server
    finally:
        server.stop()


def _group(server, modes):
    """Register a group of archives (in parallel) and unregister them afterwards: a dozen
    workers at once on 2 shared cores starve each other past the request timeout."""
    names = [m[0] for m in _installed(modes)]
    ensure_registered(server, *names)
    yield server
    client = server.management_client()
    for name in names:
        client.unregister(name, "1.0")


# Class scope: each group is unregistered when its class is done, before the next loads.
@pytest.fixture(scope="class")
def text_server(server):
    yield from _group(server, TEXT_MODES)


@pytest.fixture(scope="class")
def image_server(server):
    yield from _group(server, IMAGE_MODES + GEN_MODES)


TEXTS = ["A short one.", "The servers answered thousands of requests about coffee prices.",
         "Rain tomorrow.", "This is a rather longer sentence, so the batch needs padding and masks."]


def _scores(server, name: str) -> list[dict]:
    responses = predict_together(server, name, [{"body": t.encode()} for t in TEXTS])
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


class TestTextModes:
    @pytest.mark.parametrize("name", [m[0] for m in _installed(TEXT_MODES)[1:]])
    def test_text_mode_serves_what_fp32_eager_serves(self, text_server, name) -> None:
        server = text_server
        reference = _scores(server, "bert-fp32-eager")
        served = _scores(server, name)
        for ref, got in zip(reference, served):
            assert got["label"] == ref["label"] or abs(max(ref["scores"].values()) - 0.5) < 0.01
            for label, p in ref["scores"].items():
                assert abs(got["scores"][label] - p) < 0.01, (name, label, got["scores"][label], p)

    def test_worker_log_reports_guard_and_build_cost(self, text_server) -> None:
        server = text_server
        log = "".join(p.read_text(errors="replace") for p in server.log_dir.glob("model_log*.log"))
        for name, precision, runtime, _ in _installed(TEXT_MODES)[1:]:
            assert f"accuracy guard passed {precision}-{runtime}" in log, name
        assert "packrat mode fp32-eager ready" in log
        assert "'build_s'" in log and "'rss_delta_mb'" in log


def _image(seed: int) -> bytes:
    import sys

    from packrat.archive.builder import HANDLER_DIR

    sys.path.insert(0, str(HANDLER_DIR))
    try:
        from packrat_tasks.image import sample_jpeg
    finally:
        sys.path.remove(str(HANDLER_DIR))
    return sample_jpeg(320, 240, seed=seed)


class TestImageAndGenerationModes:
    @pytest.mark.parametrize("name", [m[0] for m in _installed(IMAGE_MODES)[1:]])
    def test_image_mode_top_k_matches_fp32_eager(self, image_server, name) -> None:
        server = image_server
        images = [_image(s) for s in range(3)]
        for img in images:
            ref = predict(server, "resnet-fp32-eager", img)
            got = predict(server, name, img)
            assert ref.status_code == got.status_code == 200, (ref.text, got.text)
            ref_p = {p["label"]: p["probability"] for p in ref.json()["predictions"]}
            got_p = {p["label"]: p["probability"] for p in got.json()["predictions"]}
            shared = set(ref_p) & set(got_p)
            assert shared, (ref_p, got_p)
            assert all(abs(ref_p[k] - got_p[k]) < 0.01 for k in shared), (ref_p, got_p)


    @pytest.mark.parametrize("name", [m[0] for m in _installed(GEN_MODES)[1:]])
    def test_generation_precision_serves_fp32_tokens(self, image_server, name) -> None:
        server = image_server
        # The guard passed at start-up (else registration failed), so on its prompts
        # the first tokens equal fp32's; here a served prompt is checked as well.
        body = {"text": "The engineers measured the latency", "max_new_tokens": 6}
        ref = predict(server, "gpt2-fp32-eager", json=body)
        got = predict(server, name, json=body)
        assert ref.status_code == got.status_code == 200, (ref.text, got.text)
        assert len(got.json()["token_ids"]) == len(ref.json()["token_ids"])


@pytest.mark.slow
def test_inductor_mode_compiles_before_ready_and_serves(server) -> None:
    name = INDUCTOR[0]
    ensure_registered(server, "bert-fp32-eager")
    server.register(name, timeout_s=900)
    # Compiled during initialize (warm-up): the first requests, of any batch size, are fast.
    for n in (1, 3, 4):
        responses = predict_together(server, name, [{"body": t.encode()} for t in TEXTS[:n]])
        assert all(r.status_code == 200 for r in responses)
        assert max(r.elapsed.total_seconds() for r in responses) < 30  # a recompile takes ~1 min
    TestTextModes().test_text_mode_serves_what_fp32_eager_serves(server, name)
    client = server.management_client()
    for n in (name, "bert-fp32-eager"):
        client.unregister(n, "1.0")
    log = "".join(p.read_text(errors="replace") for p in server.log_dir.glob("model_log*.log"))
    assert "accuracy guard passed fp32-inductor" in log


def _model_log(server) -> str:
    return "".join(p.read_text(errors="replace") for p in server.log_dir.glob("model_log*.log"))


def test_failing_guard_refuses_the_mode_with_its_numbers(server) -> None:
    import time

    client = server.management_client()
    client.register("bert-int8-strict", "bert-int8-strict", 1)  # async: its worker keeps failing
    try:
        deadline = time.monotonic() + 300
        while "accuracy guard REFUSED int8-torchscript" not in _model_log(server):
            assert time.monotonic() < deadline, "no guard refusal logged"
            time.sleep(1)
        log = _model_log(server)
        line = next(l for l in log.splitlines() if "accuracy guard REFUSED int8-torchscript" in l)
        assert "max prob diff" in line and "(<= 0.0: FAIL)" in line and "logit cosine" in line
        # Never served: no READY worker, and a prediction is not answered by the model.
        workers = client.describe("bert-int8-strict").get("workers", [])
        assert not [w for w in workers if w.get("status") == "READY"], workers
        r = requests.post(f"{server.inference_url}/predictions/bert-int8-strict", data=b"hello",
                          headers=server.inference_headers(), timeout=60)
        assert r.status_code >= 500 and "label" not in r.text, r.text
    finally:
        client.unregister("bert-int8-strict", "1.0")

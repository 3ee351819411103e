"""int8-static (`packrat.precision: int8s`): calibrated, guarded, cached, served.

Tiny seeded models. Through a real TorchServe (token auth on): int8s-openvino
(NNCF) for image and text classification and int8s-onnxruntime (QDQ) for
embeddings build, pass the accuracy guard and serve what fp32 eager serves; a
guard forced to refuse keeps the mode from ever serving. In process: the
quantised artefact is built once per archive content and mode, and a changed
archive (here: a calibration file added) never loads the old one. Pure: which
tasks, runtimes and machines int8s is refused for, and why.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import pytest
import requests
import yaml

from packrat.profile.probe import Capabilities
from packrat.tune.modes import candidate_modes, unsupported
from serving_support import ensure_registered, predict, start_server, stop_in_background
from waiting import wait_until

HAVE_OV = all(importlib.util.find_spec(m) is not None for m in ("openvino", "nncf", "onnx"))
HAVE_ORT = all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))
needs_ov = pytest.mark.skipif(not HAVE_OV, reason="openvino, nncf and onnx are needed for int8s-openvino")
needs_ort = pytest.mark.skipif(not HAVE_ORT, reason="onnxruntime and onnx are needed for int8s-onnxruntime")
STRICT = {"max_prob_diff": 0.0}  # int8 differs from fp32 by ~1e-3 in probability here: must refuse

# (archive, architecture, task, runtime, extra packrat keys)
SERVED = [
    ("resnet-int8s", "tiny-resnet", "image-classification", "openvino", {}),
    ("bert-int8s", "tiny-bert", "text-classification", "openvino", {}),
    ("emb-int8s", "tiny-bert", "feature-extraction", "onnxruntime", {}),
]


def _build(store: Path, name: str, arch: str, task: str, precision: str, runtime: str, extra: dict) -> Path:
    from packrat.archive import ArchiveOptions, build_named

    return build_named(arch, store, name, ArchiveOptions(task=task, precision=precision, runtime=runtime,
                                                         batch_size=4, max_batch_delay_ms=100, extra=extra))


# -- pure: where int8s is offered ------------------------------------------------------

def _caps(task: str, int8: str | None = None, unavailable: dict | None = None) -> Capabilities:
    return Capabilities(task=task, mode="fp32-eager", runtimes=("eager", "torchscript", "onnxruntime", "openvino"),
                        bf16=None, unavailable=unavailable or {}, int8=int8)


def test_int8s_is_offered_only_where_it_can_pay_off() -> None:
    assert unsupported("int8s-openvino", _caps("image-classification")) is None
    assert unsupported("int8s-onnxruntime", _caps("feature-extraction")) is None
    assert "onnxruntime and openvino only" in unsupported("int8s-torchscript", _caps("text-classification"))
    assert "text-generation" in unsupported("int8s-eager", _caps("text-generation"))
    no_vnni = _caps("image-classification", int8="no avx512_vnni")
    assert unsupported("int8s-openvino", no_vnni) == "no avx512_vnni"
    no_nncf = _caps("image-classification", unavailable={"int8s-openvino": "nncf is not installed"})
    assert unsupported("int8s-openvino", no_nncf) == "nncf is not installed"
    assert unsupported("int8s-onnxruntime", no_nncf) is None  # ONNX Runtime quantises by itself
    # The default short lists try it for images and encoders, not for generation.
    assert "int8s-openvino" in candidate_modes(_caps("image-classification"))[0]
    assert "int8s-openvino" in candidate_modes(_caps("text-classification"))[0]
    modes, skipped = candidate_modes(_caps("text-generation"), ["all"])
    assert not [m for m in modes if m.startswith("int8s")] and "text-generation" in skipped["int8s-eager"]


def test_cpu_check_and_archive_refusals(tmp_path: Path) -> None:
    from packrat.archive import ArchiveOptions, build_named
    from packrat.errors import ArchiveError
    from packrat_tasks.precision import int8_static_problem

    assert int8_static_problem({"avx2", "avx512_vnni"}) is None
    assert int8_static_problem({"amx_int8"}) is None
    # AVX2 alone is offered too: measured 2.5x fp32 eager for ResNet-50 (modes-avx2-epyc.md).
    assert int8_static_problem({"avx", "avx2"}) is None
    assert int8_static_problem({"avx2", "avx512f"}) is None
    assert "AVX2" in int8_static_problem({"sse4_2", "avx"}).upper()
    assert "AVX2" in int8_static_problem(set()).upper()
    with pytest.raises(ArchiveError, match="text-generation"):
        build_named("tiny-gpt2", tmp_path, "g", ArchiveOptions(precision="int8s", runtime="eager"))
    with pytest.raises(ArchiveError, match="onnxruntime or openvino"):
        build_named("tiny-bert", tmp_path, "b", ArchiveOptions(precision="int8s", runtime="torchscript"))


def test_generation_refuses_int8s_with_the_reason(tiny_store: Path) -> None:
    import packrat_handler
    from packrat_tasks.precision import PrecisionError

    config = yaml.safe_load((tiny_store / "tiny-gpt2" / "model_config.yaml").read_text())
    config["packrat"].update(precision="int8s", runtime="eager")
    with pytest.raises(PrecisionError, match="refused for text-generation.*not exported"):
        packrat_handler.load_task(str(tiny_store / "tiny-gpt2"), config)


def test_calibration_file_format(tmp_path: Path) -> None:
    from packrat_tasks.quantize_static import file_requests

    assert file_requests(str(tmp_path), "calibration.jsonl") == []
    (tmp_path / "calibration.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert [r["body"] for r in file_requests(str(tmp_path), "calibration.jsonl")] == \
        [b'{"text": "one"}', b'{"text": "two"}']
    (tmp_path / "calibration.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="line 1"):
        file_requests(str(tmp_path), "calibration.jsonl")


# -- in process: built once per archive content and mode -----------------------------

def _load(archive: Path):
    import packrat_handler

    return packrat_handler.load_task(str(archive), yaml.safe_load((archive / "model_config.yaml").read_text()))


@needs_ov
def test_changed_archive_never_loads_a_stale_quantised_model(tmp_path: Path, monkeypatch) -> None:
    from packrat_tasks.samples import sample_jpeg

    monkeypatch.setenv("PACKRAT_BUILD_CACHE", str(tmp_path / "cache"))
    archive = _build(tmp_path / "store", "r", "tiny-resnet", "image-classification", "int8s", "openvino",
                     {"calibration_samples": 4})
    first = _load(archive).runner.info["int8s"]
    assert first["cache"] == "built" and first["calibration_inputs"] == 4 and first["fp32_ops"]
    again = _load(archive).runner.info["int8s"]
    assert again["cache"] == "hit" and again["quantize_s"] == first["quantize_s"]  # the same build's record
    # A calibration file shipped in the archive changes its content: a new build that uses it.
    image = base64.b64encode(sample_jpeg(500, 300, seed=7)).decode()
    (archive / "calibration.jsonl").write_text(json.dumps({"image": image}) + "\n")
    import packrat_tasks.build_cache as build_cache

    build_cache._digests.clear()  # a worker hashes its archive once; this process plays several workers
    changed = _load(archive).runner.info["int8s"]
    assert changed["cache"] == "built", changed
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith("int8s-openvino-int8s"))
    assert len([e for e in entries if not e.endswith(".lock")]) == 2, entries


# -- through TorchServe ------------------------------------------------------------------

@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("int8s-store")
    for name, arch, task, runtime, extra in SERVED:
        _build(store, name, arch, task, "int8s", runtime, extra)
    _build(store, "resnet-int8s-strict", "tiny-resnet", "image-classification", "int8s", "openvino",
           {"guard": STRICT})
    return store


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    server = start_server(store, tmp_path_factory.mktemp("int8s-ts"))
    try:
        yield server
    finally:
        stop_in_background(server)


def _model_log(server) -> str:
    return "".join(p.read_text(errors="replace") for p in server.log_dir.glob("model_log*.log"))


def _int8s_entries(cache: Path) -> list[str]:
    """The quantised-model entries in a build cache (none before it exists)."""
    if not cache.is_dir():
        return []
    return [p.name for p in cache.iterdir() if p.name.startswith("int8s-") and not p.name.endswith(".lock")]


def _fp32_answer(archive: Path, body: bytes) -> dict:
    import packrat_handler

    config = yaml.safe_load((archive / "model_config.yaml").read_text())
    config["packrat"].update(precision="fp32", runtime="eager")
    return json.loads(json.dumps(packrat_handler.load_task(str(archive), config).run([{"body": body}])[0]))


def _body(task: str) -> bytes:
    if task == "image-classification":
        from packrat_tasks.samples import sample_jpeg

        return sample_jpeg(300, 200, seed=42)
    return b"The servers answered thousands of requests about coffee prices."


@pytest.mark.torchserve
@pytest.mark.skipif(not (HAVE_OV and HAVE_ORT), reason="openvino, nncf, onnxruntime and onnx are needed")
def test_int8s_builds_guards_and_serves_what_fp32_serves(server) -> None:
    # The cache is the server's, which the refused model's build also fills (when its test ran
    # first): count only the entries these registrations add.
    cache = Path(server.model_store) / ".packrat-build-cache"
    before = set(_int8s_entries(cache))
    ensure_registered(server, *[s[0] for s in SERVED])
    log = _model_log(server)
    for name, _, task, runtime, _ in SERVED:
        assert f"accuracy guard passed int8s-{runtime}" in log
        assert f"int8s {runtime} built" in log
        body = _body(task)
        got = predict(server, name, body)
        assert got.status_code == 200, got.text
        # The reference: the same archive in fp32 eager, in this process (same weights and preprocessing).
        got, want = got.json(), _fp32_answer(server.model_store / name, body)
        if task == "image-classification":
            g = {p["label"]: p["probability"] for p in got["predictions"]}
            w = {p["label"]: p["probability"] for p in want["predictions"]}
            assert max(abs(g[k] - w[k]) for k in g.keys() & w.keys()) < 0.05 and len(g.keys() & w.keys()) >= 2
        elif task == "text-classification":
            assert max(abs(got["scores"][k] - want["scores"][k]) for k in want["scores"]) < 0.05
        else:
            import numpy as np

            a, b = np.array(got["embedding"]), np.array(want["embedding"])
            assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.99
    # The quantised models are in the build cache beside the store, one per (archive, mode).
    built = sorted(set(_int8s_entries(cache)) - before)
    assert len([b for b in built if b.startswith("int8s-openvino-int8s")]) == 2, built
    assert len([b for b in built if b.startswith("int8s-onnxruntime-int8s")]) == 1, built


@pytest.mark.torchserve
@needs_ov
def test_refused_int8s_is_never_served(server) -> None:
    client = server.management_client()
    client.register("resnet-int8s-strict", "resnet-int8s-strict", 1)  # async: its worker keeps failing
    try:
        wait_until(lambda: "accuracy guard REFUSED int8s-openvino" in _model_log(server), 600,
                   "the guard's refusal in the model log")
        line = next(x for x in _model_log(server).splitlines() if "accuracy guard REFUSED int8s-openvino" in x)
        assert "(<= 0.0: FAIL)" in line and "top-1 agreement" in line
        # Never served: TorchServe restarts the worker, every restart is refused again (from the
        # cached verdict, without re-guarding), no worker becomes READY, and a request gets no
        # model answer (an error, or no answer while TorchServe waits for a worker).
        wait_until(lambda: [x for x in _model_log(server).splitlines()
                            if "REFUSED int8s-openvino" in x and "(cached verdict)" in x], 600,
                   "a restart refused from the cached verdict")
        workers = client.describe("resnet-int8s-strict").get("workers", [])
        assert not [w for w in workers if w.get("status") == "READY"], workers
        try:
            r = requests.post(f"{server.inference_url}/predictions/resnet-int8s-strict",
                              data=_body("image-classification"), headers=server.inference_headers(), timeout=5)
            answer: tuple[int, str] | None = (r.status_code, r.text)
        except requests.exceptions.ReadTimeout:
            answer = None  # held while TorchServe waits for a READY worker that never comes
        # either way no model answer: none at all, or an error without predictions
        assert answer is None or (answer[0] >= 500 and "predictions" not in answer[1]), answer
    finally:
        client.unregister("resnet-int8s-strict", "1.0")

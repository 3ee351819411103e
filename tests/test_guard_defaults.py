"""The accuracy guard at its shipped default thresholds, on a model with real weights.

The tiny seeded archives cannot show the defaults refusing anything: they answer
every input with one class at a near-tie, so no row is decisive and top-1
agreement holds by construction. Here the model is real (all-MiniLM-L6-v2's
encoder with a 4-topic head, tests/classifier_support.py), loaded the way a
TorchServe worker loads it (the archive's own `packrat_handler.load_task`:
reference, mode build, guard), with `packrat.guard` unset:

  - weights perturbed until top-1 agreement with fp32 on 200 held-out sentences
    is ~90 % (measured here and asserted) are refused; a mild perturbation of the
    same kind (agreement 100 %) is accepted, so the refusal is about the damage;
  - the real bf16 modes are accepted, with decisive rows, so the top-1 check bit;
  - the real int8 modes are refused on this classifier today (see INT8_FINDING);
  - on the real all-MiniLM-L6-v2 embedder (mean pooling + L2 norm, as served),
    int8s-openvino is accepted; int8-eager and int8-onnxruntime are refused
    (EMBEDDER_FINDING).

Why int8 is refused, measured (docs/benchmarks/guard-int8-epyc.md): the error is
the int8 encoder's (per-tensor weights, FFN activation outliers), not the head
or the shipped pooler; it lands in the guard texts that lie off the head's four
topics, where probabilities are mid-range. On 24 more off-topic sentences the
shipped int8 modes flipped 3-6 decisive answers, so the default bound catches a
real change; a mean-pooling classifier fails the same way. Not a test-model or
a threshold problem, so both stay.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import packrat_handler  # the handler every archive ships (handlers/: on the path, pyproject's pythonpath)
from classifier_support import LABELS, build_topic_archive, topic_texts
from packrat.archive import build_from_dir
from packrat.archive.local_tokenizers import minilm_dir
from packrat.modes import INT8_DOT_PRODUCT_FLAGS, bf16_problem, cpu_flags, int8_static_problem
from packrat_tasks import guard
from packrat_tasks.runtime import RUNTIMES, runtime

ARCHIVE = "topic"
EMBEDDER = "minilm"  # the real all-MiniLM-L6-v2, served as a feature-extraction archive
DEGRADED = "test-perturbed"  # a test-only runtime: fp32 eager on a perturbed copy of the weights
# Relative noise (x each weight tensor's std) tried, mildest first; measured on the 2-core
# EPYC: 0.25 -> 98 %, 0.3 -> 92.5 %, 0.32 -> 89.5 %, 0.4 -> 66 % top-1 agreement on the held-out set.
# From 0.32 (each level tried is a model load and 200 answers): where it keeps more than 90 %,
# the next level is tried, and the level nearest 90 % is still the one judged.
SIGMAS = (0.32, 0.35, 0.4)
TARGET, TOLERANCE = 0.90, 0.05  # "top-1 agreement ~90 %"
MILD_SIGMA = 0.02  # the same perturbation, harmless: every answer kept
# Anything passes: only to read what the degraded mode answers (the verdict is keyed
# by config, so this never lends its pass to a default-threshold load).
PERMISSIVE = {"min_top1_agreement": 0.0, "max_prob_diff": 1.0, "min_cosine": -1.0}
# Measured 2026-12-04 on the 2-core EPYC (VNNI, avx512_bf16), after int8s dropped NNCF's
# SmoothQuant and ONNX Runtime's int8 took per-channel weights: the guard's 8 texts keep
# their top-1 class (8/8) in every int8 mode, but max prob diff / logit cosine are
# int8-eager 0.189 / 0.9768, int8-onnxruntime 0.104 / 0.9968, int8s-openvino 0.052 / 0.9984
# (bf16: 0.006 / 1.0000). int8s-openvino's 0.052 is close to the 0.05 bound: another CPU
# may pass it (a non-strict xfail there: THIN below).
INT8_FINDING = ("defaults refuse int8 on this classifier: max prob diff 0.05-0.19 > 0.05 with top-1 8/8 "
                "(measured 2026-12-04); see the module docstring")
# The embedder's min row cosine on the guard texts, same run: int8s-openvino 0.9912 (accepted;
# 0.915 with SmoothQuant), int8-onnxruntime 0.9885 (0.945 per-tensor), int8-eager 0.921
# (torch's per-tensor weights and 7-bit activations).
EMBEDDER_FINDING = ("defaults refuse int8-eager (min cosine 0.921) and int8-onnxruntime (0.9885) on the "
                    "real MiniLM embedder (measured 2026-12-04)")
# The finding that int8 keeps every guard text's class was measured with VNNI. With AVX2's
# int8 path alone (no VNNI/AMX, offered since int8-static is tried there) it does not hold:
# on a Zen 3 EPYC (2026-12-05) int8s-openvino flipped one of the 8 texts (top-1 7/8, max prob
# diff 0.095, cosine 0.9964), so the defaults refuse it for the class as well.
INT8_DOT_PRODUCT_HERE = bool(cpu_flags() & set(INT8_DOT_PRODUCT_FLAGS))


def _bf16_here() -> str | None:
    return bf16_problem(cpu_flags(), bool(torch.backends.mkldnn.is_available()
                                          and torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _missing(*modules: str) -> str | None:
    gone = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(gone)} not installed (pip install -e '.[runtimes]')" if gone else None


# mode -> why it cannot run here (None: it can)
BF16_MODES = {
    "bf16-eager": _bf16_here(),
    "bf16-torchscript": _bf16_here(),
    "bf16-openvino": _bf16_here() or _missing("openvino", "onnx"),
}
INT8_MODES = {
    "int8-eager": None,
    "int8-onnxruntime": _missing("onnxruntime", "onnx"),
    "int8s-openvino": _missing("openvino", "onnx", "nncf") or int8_static_problem(cpu_flags()),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("guard-defaults-store")
    build_topic_archive(store, ARCHIVE, tmp_path_factory.mktemp("guard-defaults-scratch"))
    build_from_dir(minilm_dir(), store, EMBEDDER)
    return store


@pytest.fixture(scope="module", autouse=True)
def degraded_runtime():
    """Register DEGRADED in this process for the module: it reads its noise level from
    the archive config's `packrat.test_noise_sigma` (so the build cache keys each level apart)."""

    @runtime(DEGRADED)
    def _perturbed(module, example_inputs, config, precision, runner):
        sigma = float(config["packrat"]["test_noise_sigma"])
        noisy = copy.deepcopy(module)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in noisy.parameters():
                if p.numel() > 1:  # LayerNorm's all-ones weights have no spread to scale by
                    p.add_(torch.randn(p.shape, generator=gen) * sigma * p.std())

        def run(*tensors: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return noisy(*tensors)

        return run

    yield
    RUNTIMES.pop(DEGRADED)


def _config(store: Path, archive: str = ARCHIVE, **packrat: Any) -> dict[str, Any]:
    config = yaml.safe_load((store / archive / "model_config.yaml").read_text())
    config["packrat"].update(packrat)
    return config


def _load(store: Path, archive: str = ARCHIVE, **packrat: Any):
    """The archive's own handler loading the model as a TorchServe worker does."""
    return packrat_handler.load_task(str(store / archive), _config(store, archive, **packrat))


def _answers(task) -> torch.Tensor:
    texts, _ = topic_texts(200, seed=7)  # held out: the head was fitted on seed 1
    batch = task.preprocess([{"body": t.encode()} for t in texts])
    assert batch.valid == list(range(len(texts))), batch.errors
    return task.forward(batch).outputs.float().argmax(-1)


@pytest.fixture(scope="module")
def reference(store: Path) -> torch.Tensor:
    task = _load(store)
    answers = _answers(task)
    _, labels = topic_texts(200, seed=7)
    # The classifier is one: right on the held-out sentences, every topic answered.
    assert (answers == torch.tensor(labels)).float().mean() >= 0.95
    assert set(answers.tolist()) == set(range(len(LABELS)))
    return answers


def _agreement(store: Path, reference: torch.Tensor, sigma: float) -> float:
    task = _load(store, runtime=DEGRADED, test_noise_sigma=sigma, guard=PERMISSIVE)
    return float((_answers(task) == reference).float().mean())


def test_defaults_refuse_weights_degraded_to_90_percent_top1(store: Path, reference: torch.Tensor) -> None:
    agreements: dict[float, float] = {}
    for sigma in SIGMAS:  # mildest first; stop once at or below the target
        agreements[sigma] = _agreement(store, reference, sigma)
        if agreements[sigma] <= TARGET:
            break
    sigma = min(agreements, key=lambda s: abs(agreements[s] - TARGET))
    assert abs(agreements[sigma] - TARGET) <= TOLERANCE, f"no noise level gave ~90 % agreement: {agreements}"
    with pytest.raises(guard.AccuracyGuardError) as info:
        _load(store, runtime=DEGRADED, test_noise_sigma=sigma)
    report = info.value.report
    print(f"sigma {sigma}: held-out top-1 agreement {agreements[sigma]:.3f}; {report.message}")
    assert report.thresholds == guard.DEFAULTS and report.mode == f"fp32-{DEGRADED}"
    assert not report.ok and report.kind == "classification"
    # The refusal's own numbers break at least one default, and the message names it.
    m = report.metrics
    broken = [m["top1_agreement_decisive"] < guard.DEFAULTS["min_top1_agreement"],
              m["max_prob_diff"] > guard.DEFAULTS["max_prob_diff"],
              m["logit_cosine"] < guard.DEFAULTS["min_cosine"]]
    assert any(broken) and "FAIL" in report.message, report.message


def test_defaults_accept_the_same_perturbation_when_it_is_harmless(store: Path, reference: torch.Tensor) -> None:
    # One load at the default thresholds (it passes, so no permissive load is needed to read
    # its answers): the same seeded perturbation _agreement() would load.
    task = _load(store, runtime=DEGRADED, test_noise_sigma=MILD_SIGMA)
    assert float((_answers(task) == reference).float().mean()) == 1.0
    g = task.runner.guard
    assert g["ok"] and g["thresholds"] == guard.DEFAULTS, g["message"]
    assert g["metrics"]["decisive_rows"] >= 6, g["message"]  # the top-1 check had rows to judge


@pytest.mark.parametrize("mode", list(BF16_MODES))
def test_defaults_accept_the_real_bf16_modes(store: Path, mode: str) -> None:
    if BF16_MODES[mode]:
        pytest.skip(BF16_MODES[mode])
    precision, runtime_ = mode.split("-", 1)
    g = _load(store, precision=precision, runtime=runtime_).runner.guard
    assert g["ok"] and g["thresholds"] == guard.DEFAULTS, g["message"]
    assert g["metrics"]["decisive_rows"] >= 6 and g["metrics"]["top1_agreement_decisive"] == 1.0, g["message"]


# Within this of a default bound the verdict may go either way on another CPU (its fp32
# reference and int8 kernels differ): such a case is a non-strict xfail, so CI on another
# CPU neither fails on a pass nor on a refusal; the assertions on the figures still hold.
THIN = {"int8s-openvino": "max prob diff 0.052 against 0.05 on the EPYC"}
EMBEDDER_THIN = {"int8s-openvino": "min cosine 0.9912 against 0.99 on the EPYC (accepted there)",
                 "int8-onnxruntime": "min cosine 0.9885 against 0.99 on the EPYC (refused there)"}


def _case(mode: str, thin: dict[str, str], refused: bool, finding: str):
    if mode in thin:
        return pytest.param(mode, marks=[pytest.mark.xfail(strict=False, raises=guard.AccuracyGuardError,
                                                           reason=f"{finding}; thin margin: {thin[mode]}")])
    marks = [pytest.mark.xfail(strict=True, raises=guard.AccuracyGuardError, reason=finding)] if refused else []
    return pytest.param(mode, marks=marks)


@pytest.mark.parametrize("mode", [_case(m, THIN, True, INT8_FINDING) for m in INT8_MODES])
def test_defaults_accept_the_real_int8_modes(store: Path, mode: str) -> None:
    if INT8_MODES[mode]:
        pytest.skip(INT8_MODES[mode])
    precision, runtime_ = mode.split("-", 1)
    try:
        g = _load(store, precision=precision, runtime=runtime_).runner.guard
    except guard.AccuracyGuardError as exc:
        # What the finding says: the class is kept, the probabilities are not (with VNNI/AMX;
        # INT8_DOT_PRODUCT_HERE says why not without them).
        if INT8_DOT_PRODUCT_HERE:
            assert exc.report.metrics["top1_agreement_decisive"] == 1.0, exc.report.message
        print(exc.report.message)
        raise
    assert g["ok"] and g["metrics"]["decisive_rows"] >= 6, g["message"]


@pytest.mark.parametrize("mode", [_case(m, EMBEDDER_THIN, m == "int8-eager", EMBEDDER_FINDING)
                                  for m in INT8_MODES])
def test_defaults_accept_the_real_int8_modes_on_the_real_embedder(store: Path, mode: str) -> None:
    if INT8_MODES[mode]:
        pytest.skip(INT8_MODES[mode])
    precision, runtime_ = mode.split("-", 1)
    try:
        g = _load(store, EMBEDDER, precision=precision, runtime=runtime_).runner.guard
    except guard.AccuracyGuardError as exc:
        # Close, not broken: the embeddings still point the same way.
        assert exc.report.metrics["min_cosine"] > 0.9, exc.report.message
        print(exc.report.message)
        raise
    assert g["ok"] and g["kind"] == "embedding" and g["thresholds"] == guard.DEFAULTS, g["message"]
    assert g["metrics"]["min_cosine"] >= guard.DEFAULTS["min_cosine"], g["message"]

"""Accuracy guard and mode refusals, in process on tiny models (the TorchServe path is
tests/test_modes_serving.py)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from packrat.archive import ArchiveOptions, build_named
from packrat_tasks import guard  # handlers/: on the path (pyproject's pythonpath)
from packrat_tasks.precision import PrecisionError, bf16_problem
from packrat_tasks.runtime import make_runner
from modes_support import noisy_runtime

HAVE_OV = importlib.util.find_spec("openvino") is not None and importlib.util.find_spec("onnx") is not None


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("guard-store")
    build_named("tiny-bert", store, "bert")
    build_named("tiny-bert", store, "emb", ArchiveOptions(task="feature-extraction"))
    build_named("tiny-gpt2", store, "gpt2", ArchiveOptions(max_new_tokens_cap=8))
    return store


def _load(store: Path, name: str, **packrat):
    import packrat_handler  # noqa: F401 - handlers/ is on sys.path

    config = yaml.safe_load((store / name / "model_config.yaml").read_text())
    config = copy.deepcopy(config)
    config["packrat"].update(packrat)
    return packrat_handler.load_task(str(store / name), config)


@pytest.fixture
def broken_runtime():
    """A deliberately broken mode: the right shapes, every logit perturbed by noise."""
    with noisy_runtime("test-broken"):
        yield "test-broken"


def test_broken_mode_is_refused_with_its_numbers(store, broken_runtime) -> None:
    with pytest.raises(guard.AccuracyGuardError) as info:
        _load(store, "bert", runtime=broken_runtime)
    report = info.value.report
    assert not report.ok and report.mode == "fp32-test-broken" and report.kind == "classification"
    assert report.metrics["logit_cosine"] < 0.99  # noise 3x the largest logit
    assert "REFUSED fp32-test-broken" in str(info.value) and "logit cosine" in str(info.value)


def test_broken_embedding_mode_is_refused(store, broken_runtime) -> None:
    with pytest.raises(guard.AccuracyGuardError) as info:
        _load(store, "emb", runtime=broken_runtime)
    assert info.value.report.kind == "embedding" and info.value.report.metrics["min_cosine"] < 0.99


def test_impossible_threshold_refuses_a_good_mode_and_defaults_accept_it(store) -> None:
    task = _load(store, "bert", precision="int8", runtime="torchscript")
    summary = task.runner.summary()
    assert summary["guard"]["ok"] and summary["guard"]["metrics"]["max_prob_diff"] > 0
    with pytest.raises(guard.AccuracyGuardError) as info:
        _load(store, "bert", precision="int8", runtime="torchscript", guard={"max_prob_diff": 0})
    assert "(<= 0.0: FAIL)" in str(info.value)
    with pytest.raises(guard.AccuracyGuardError):
        _load(store, "emb", precision="int8", runtime="eager", guard={"min_cosine": 1.5})


def test_generation_guard_compares_greedy_tokens(store) -> None:
    task = _load(store, "gpt2", precision="int8")
    g = task.runner.guard
    assert g["kind"] == "generation" and g["metrics"]["prompts"] == 8
    assert len(g["details"][0]["reference"]) == 8  # first N = min(gen_tokens 8, cap 8)
    # Where tokens diverge is reported per prompt (positions are None when identical).
    report = guard.compare_generation("bf16-eager", [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]],
                                      dict(guard.DEFAULTS, gen_tokens=3))
    assert not report.ok and report.metrics["first_divergence"] == [None, 1]
    assert "prompt 1: token 1" in report.message


def test_decisive_rows_only_count_for_top1() -> None:
    th = dict(guard.DEFAULTS)
    ref = torch.tensor([[2.0, 0.0], [0.001, 0.0]])  # row 0 decisive, row 1 a near-tie
    flipped_tie = torch.tensor([[2.0, 0.0], [0.0, 0.001]])
    r = guard.compare_classification("m", ref, flipped_tie, th)
    assert r.ok and r.metrics["decisive_rows"] == 1 and r.metrics["top1_agreement_all"] == 0.5
    flipped_decisive = torch.tensor([[0.0, 2.0], [0.001, 0.0]])
    assert not guard.compare_classification("m", ref, flipped_decisive, th).ok


def test_guard_thresholds_are_validated() -> None:
    assert guard.thresholds({"packrat": {"guard": {"min_cosine": 0.9}}})["min_cosine"] == 0.9
    with pytest.raises(ValueError, match="unknown keys"):
        guard.thresholds({"packrat": {"guard": {"min_cosin": 0.9}}})


def test_bf16_refused_without_native_bf16() -> None:
    assert bf16_problem({"avx2", "avx512f"}, True).startswith("packrat.precision bf16 needs a CPU")
    assert "oneDNN" in bf16_problem({"avx512_bf16"}, False)
    assert bf16_problem({"amx_bf16"}, True) is None and bf16_problem({"avx512_bf16"}, True) is None


def test_unsupported_combinations_are_refused_clearly(store) -> None:
    with pytest.raises(PrecisionError, match="int8-inductor is not offered"):
        _load(store, "bert", precision="int8", runtime="inductor")
    with pytest.raises(PrecisionError, match="bf16-onnxruntime is not offered"):
        _load(store, "bert", precision="bf16", runtime="onnxruntime")
    with pytest.raises(ValueError, match="unknown packrat.precision"):
        _load(store, "bert", precision="fp8")
    with pytest.raises(ValueError, match="eager only"):
        _load(store, "gpt2", runtime="torchscript")


@pytest.mark.skipif(not HAVE_OV, reason="openvino/onnx not installed (pip install -e '.[runtimes]')")
def test_openvino_gets_the_slot_threads_and_explicit_precision(store) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # what claim_and_pin sets for a 1-thread slot
    try:
        task = _load(store, "bert", runtime="openvino")
    finally:
        torch.set_num_threads(before)
    ov = task.runner.info["openvino"]
    assert ov["INFERENCE_NUM_THREADS"] == "1" and "float32" in ov["INFERENCE_PRECISION_HINT"]
    assert ov["NUM_STREAMS"] == "1" and ov["ENABLE_CPU_PINNING"] == "True"


def test_ipex_mode(store) -> None:
    try:
        import intel_extension_for_pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or IPEX's own torch-version check
        with pytest.raises(RuntimeError, match="torch 2.8"):
            _load(store, "bert", runtime="ipex")
        pytest.skip(f"intel-extension-for-pytorch not importable beside torch {torch.__version__}: "
                    f"{str(exc)[:120]} (it supports torch 2.8 only; see docs/modes.md)")
    task = _load(store, "bert", runtime="ipex")
    assert task.runner.guard["ok"]


def test_make_runner_warms_up_and_records_cost() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    runner = make_runner(module, (torch.zeros(2, 8),), {"packrat": {"precision": "int8"}})
    assert runner.mode == "int8-eager" and runner.build_s > 0 and runner.rss_mb > 0
    assert runner(torch.ones(3, 8)).shape == (3, 4)


class _Shapes(torch.nn.Module):
    """A linear layer that records the shape of every input it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape))
        return self.linear(x)


def test_eager_warms_up_on_a_small_input() -> None:
    """Eager specialises nothing, so its warm-up is one small call (a full-size one cost a
    BERT-base swap seconds): the example's first row, or what the task passes."""
    example = (torch.zeros(4, 8),)
    eager = _Shapes().eval()
    make_runner(eager, example, {"packrat": {"precision": "fp32", "runtime": "eager"}})
    assert eager.seen == [(1, 8)]
    given = _Shapes().eval()
    make_runner(given, example, {"packrat": {"precision": "fp32", "runtime": "eager"}},
                warmup_inputs=(torch.zeros(2, 8),))
    assert given.seen == [(2, 8)]

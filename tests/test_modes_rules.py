"""packrat.modes: one parse and one format of the mode string, and the rules every caller reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from packrat import modes
from packrat.modes import ExecutionMode
from packrat.profile.fingerprint import config_in_mode, mode_from_config, split_mode


def test_parse_and_format_round_trip() -> None:
    for text in modes.every_mode():
        assert str(ExecutionMode.parse(text)) == text
    assert ExecutionMode.parse(" BF16-OpenVINO ") == ExecutionMode("bf16", "openvino")
    assert len(modes.every_mode()) == len(modes.PRECISIONS) * len(modes.RUNTIMES)
    for bad in ("fp32", "fp32-", "-eager", ""):
        with pytest.raises(ValueError, match="<precision>-<runtime>"):
            ExecutionMode.parse(bad)


def test_names_are_kept_and_judged_apart() -> None:
    # A fingerprint records whatever a config says; whether it runs is unknown()'s question.
    odd = ExecutionMode.parse("fp16-tensorrt")
    assert str(odd) == "fp16-tensorrt" and "unknown mode" in odd.unknown()
    assert ExecutionMode.parse("int8s-openvino").unknown() is None


def test_the_config_is_read_as_the_worker_reads_it() -> None:
    assert ExecutionMode.from_config({}) == ExecutionMode("fp32", "eager")
    assert ExecutionMode.from_config({"packrat": {"precision": "", "runtime": None}}) == ExecutionMode()
    assert ExecutionMode.from_config({"packrat": {"precision": "BF16", "runtime": "TorchScript"}}) == \
        ExecutionMode("bf16", "torchscript")
    config = {"batchSize": 4, "packrat": {"task": "noop", "precision": "fp32"}}
    moved = ExecutionMode.parse("int8-onnxruntime").in_config(config)
    assert moved == {"batchSize": 4, "packrat": {"task": "noop", "precision": "int8", "runtime": "onnxruntime"}}
    assert config["packrat"] == {"task": "noop", "precision": "fp32"}  # a copy
    # The fingerprint's helpers are this parse.
    assert mode_from_config(moved) == "int8-onnxruntime" and split_mode("bf16-ipex") == ("bf16", "ipex")
    assert config_in_mode(config, "int8-onnxruntime") == moved


def test_which_pairs_run_for_which_task() -> None:
    assert modes.pairing_refusal(ExecutionMode("bf16", "onnxruntime"))
    assert modes.pairing_refusal(ExecutionMode("int8", "inductor"))
    assert modes.pairing_refusal(ExecutionMode("int8", "ipex"))
    assert modes.pairing_refusal(ExecutionMode("int8", "openvino")) is None
    assert modes.int8s_runtime_refusal("torchscript") and modes.int8s_runtime_refusal("openvino") is None
    assert modes.int8s_task_refusal("text-generation") and modes.int8s_task_refusal("image-classification") is None
    assert "eager only" in modes.task_refusal("text-generation", "torchscript")
    assert modes.task_refusal("text-generation", "eager") is None
    assert modes.task_refusal("text-classification", "openvino") is None


def test_cpu_flags_decide_bf16_and_int8_static(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n\nflags\t\t: amx_bf16\n")
    flags = modes.cpu_flags(str(cpuinfo))
    assert flags == {"fpu", "avx2", "avx512f", "avx512_vnni"}  # the first CPU's
    assert modes.int8_static_problem(flags) is None
    assert "needs a CPU with native bf16" in modes.bf16_problem(flags, True)
    assert modes.bf16_problem({"amx_bf16"}, True) is None and "oneDNN" in modes.bf16_problem({"amx_bf16"}, False)
    assert modes.cpu_flags(str(tmp_path / "missing")) == set()

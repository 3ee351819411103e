"""Execution modes: the precisions, the runtimes, the mode string and what a CPU supports.

    ExecutionMode.parse("bf16-openvino")   -> ExecutionMode(precision="bf16", runtime="openvino")
    ExecutionMode.from_config(config)      the mode of a model_config.yaml (packrat.precision/runtime)
    str(mode)                              "<precision>-<runtime>", the profile fingerprint's mode

A mode is "<precision>-<runtime>" (docs/modes.md). Which pairs run at all, for
which task, is decided here (pairing_refusal, task_refusal); which of them this
machine runs is the CPU's flags (bf16_problem, int8_static_problem) and what
imports (packrat.profile.probe). The archive builder, the tuner, the profile
fingerprint and the handler in TorchServe's worker all read these rules.

Standard library only: TorchServe's Python worker imports it (the handler's
packrat_tasks, copied into each archive, find it in the installed package, as
they find packrat.slots), before it pins itself and before torch is loaded.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# bf16: autocast (weights fp32, each matmul casts to bf16); bf16w: the weights themselves in
# bf16 (eager only); int8s: int8-static, calibrated.
PRECISIONS = ("fp32", "bf16", "bf16w", "int8", "int8s")
BF16_PRECISIONS = ("bf16", "bf16w")  # the precisions that need native bf16 (bf16_problem)
RUNTIMES = ("eager", "torchscript", "inductor", "onnxruntime", "openvino", "ipex")
# Runtimes that run an exported ONNX graph (int8s quantises that graph; its quantisation tools
# target these two only).
INT8S_RUNTIMES = ("onnxruntime", "openvino")
DEFAULT_PRECISION = "fp32"
DEFAULT_RUNTIME = "eager"
TEXT_GENERATION = "text-generation"  # the one task whose decoding loop runs eager only

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic
# /proc/cpuinfo flags of int8 dot-product instructions (u8 x s8 -> s32 in one op).
INT8_DOT_PRODUCT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# ... and of SIMD int8 multiply-add at all: those, or AVX2's vpmaddubsw/vpmaddwd pair. With
# AVX2 alone int8s still paid off for convolutions (ResNet-50 int8s-openvino 2.5x fp32 eager on
# a Zen 3 EPYC, docs/benchmarks/modes-avx2-epyc.md), not for BERT's matmuls (as fp32-openvino):
# tuning measures which.
INT8_FLAGS = (*INT8_DOT_PRODUCT_FLAGS, "avx2")


@dataclass(frozen=True)
class ExecutionMode:
    """One (precision, runtime) pair. The names are kept as given (lower case): whether
    they are known is unknown()'s question, so a fingerprint can record any config."""

    precision: str = DEFAULT_PRECISION
    runtime: str = DEFAULT_RUNTIME

    @classmethod
    def parse(cls, text: str) -> ExecutionMode:
        """"bf16-openvino" -> ExecutionMode("bf16", "openvino"); ValueError when it is not
        "<precision>-<runtime>" (the names are not checked: see unknown())."""
        precision, sep, runtime = str(text).strip().lower().partition("-")
        if not sep or not precision or not runtime:
            raise ValueError(f"mode {text!r} is not <precision>-<runtime>, e.g. bf16-openvino")
        return cls(precision, runtime)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ExecutionMode:
        """The mode a worker runs for this model_config.yaml: its `packrat:` section's
        precision and runtime (missing or empty: fp32, eager)."""
        section = config.get("packrat")
        section = section if isinstance(section, Mapping) else {}

        def value(key: str, default: str) -> str:
            found = section.get(key)
            return default if found in (None, "") else str(found).lower()

        return cls(value("precision", DEFAULT_PRECISION), value("runtime", DEFAULT_RUNTIME))

    def __str__(self) -> str:
        return f"{self.precision}-{self.runtime}"

    def unknown(self) -> str | None:
        """Why these are not a known precision and runtime, or None."""
        if self.precision in PRECISIONS and self.runtime in RUNTIMES:
            return None
        return f"unknown mode (precisions {', '.join(PRECISIONS)}; runtimes {', '.join(RUNTIMES)})"

    def in_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of an archive's config that runs in this mode (packrat.precision/runtime
        set), everything else unchanged: one base archive serves every mode."""
        out = dict(config)
        section = dict(out.get("packrat") or {})
        section.update(precision=self.precision, runtime=self.runtime)
        out["packrat"] = section
        return out


def every_mode() -> list[str]:
    """Every known mode string, runtime by runtime."""
    return [str(ExecutionMode(p, r)) for r in RUNTIMES for p in PRECISIONS]


# -- which pairs run, for which task (the same on every machine) ----------------


def int8s_task_refusal(task: str | None) -> str | None:
    """Why int8-static cannot serve `task`, or None."""
    if task == TEXT_GENERATION:
        return ("int8-static is refused for text-generation: the decoding loop is not exported, and "
                "calibrated activation ranges do not bound later tokens (docs/modes.md)")
    return None


def int8s_runtime_refusal(runtime: str) -> str | None:
    """Why int8-static cannot run on `runtime`, or None."""
    if runtime not in INT8S_RUNTIMES:
        return f"int8-static runs on {' and '.join(INT8S_RUNTIMES)} only"
    return None


def task_refusal(task: str | None, runtime: str) -> str | None:
    """Why `task` cannot run on `runtime` (int8s aside: see int8s_task_refusal), or None."""
    if task == TEXT_GENERATION and runtime != "eager":
        return "text-generation runs eager only (the decoding loop is not traced or exported)"
    return None


def pairing_refusal(mode: ExecutionMode) -> str | None:
    """Why this precision is not offered with this runtime, or None (int8s: see
    int8s_runtime_refusal, which tuning asks before the machine's own checks)."""
    if mode.precision == "bf16" and mode.runtime == "onnxruntime":
        return "ONNX Runtime's CPU provider has no bf16 kernels for these graphs"
    if mode.precision == "int8" and mode.runtime in ("inductor", "ipex"):
        return f"int8 is not offered with {mode.runtime}"
    if mode.precision == "bf16w" and mode.runtime != "eager":
        # The graph runtimes have their own bf16 (bf16-torchscript freezes bf16 weights,
        # OpenVINO's bf16 hint): bf16w is eager's, for the loop nothing traces (GPT-2).
        return "bf16w (bf16 weights) runs eager only; use bf16 with the graph runtimes"
    return None


# -- what this CPU supports -------------------------------------------------------


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU listed (all cores of a socket share them)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_problem(flags: Iterable[str], mkldnn_bf16: bool, precision: str = "bf16") -> str | None:
    """Why `precision` (bf16 or bf16w: BF16_PRECISIONS) should not run here, or None when it should.

    Both must hold: the CPU has a native bf16 instruction set (avx512_bf16 or
    AMX), and torch's oneDNN build reports bf16 support. Without them
    bf16 matmuls are emulated: slower than fp32 and no more accurate.
    """
    if not set(flags) & set(BF16_FLAGS):
        return (f"packrat.precision {precision} needs a CPU with native bf16 (flags avx512_bf16 or "
                "amx_bf16); this CPU has neither. Use fp32 or int8.")
    if not mkldnn_bf16:
        return (f"packrat.precision {precision}: torch's oneDNN (mkldnn) reports no bf16 support on "
                "this CPU/build. Use fp32 or int8.")
    return None


def int8_static_problem(flags: Iterable[str]) -> str | None:
    """Why int8-static should not be expected to pay off here, or None when it may.

    Without any SIMD int8 multiply-add (VNNI, AMX or at least AVX2) int8 arithmetic is
    emulated: correct, but no faster than fp32. Tuning offers int8s only with one of
    them and keeps it only where it measures faster (with AVX2 alone it did for
    ResNet-50, not for BERT-base: docs/benchmarks/modes-avx2-epyc.md).
    """
    if not set(flags) & set(INT8_FLAGS):
        return ("int8-static (int8s) needs SIMD int8 multiply-add instructions for its speed (flags "
                f"{', '.join(INT8_FLAGS)}); this CPU has none")
    return None


def library_versions(names: Iterable[str]) -> dict[str, str | None]:
    """The installed version of each distribution (None: not installed), from package
    metadata: nothing is imported. What a runtime's build or a probe's answer depends on
    (the worker's build cache keys entries by them; a tune reuses a probe while they stay)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


__all__ = [
    "BF16_FLAGS", "BF16_PRECISIONS", "DEFAULT_PRECISION", "DEFAULT_RUNTIME", "INT8S_RUNTIMES", "INT8_DOT_PRODUCT_FLAGS",
    "INT8_FLAGS", "PRECISIONS",
    "RUNTIMES", "TEXT_GENERATION", "ExecutionMode", "bf16_problem", "cpu_flags", "every_mode",
    "int8_static_problem", "int8s_runtime_refusal", "int8s_task_refusal", "library_versions", "pairing_refusal",
    "task_refusal",
]

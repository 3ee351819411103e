"""Which execution modes to try for an archive on this machine (pure: no torch, no I/O).

    candidate_modes(caps, requested=None) -> (modes to try, {mode: why not})

A mode is "<precision>-<runtime>" (docs/modes.md). It is a candidate when the
machine supports it (packrat.profile.probe.Capabilities: bf16 only with
native bf16, a runtime only where it imports) and the task can run it
(text-generation: eager only; no bf16 on ONNX Runtime; no int8 on inductor
or IPEX; int8s — int8-static, calibrated — only on ONNX Runtime and OpenVINO,
with its quantisation tool importable, on a CPU with VNNI or AMX int8, and
never for text-generation). The archive's own mode always comes first: it is what serves until
a mode more than 3 % faster is found (packrat.plan.MODE_MARGIN), and it wins within that.

Without `requested`, the candidates are a short list per task — the modes
that were fastest in the measurements of docs/modes-benchmark.md — so that
tuning every demo model fits in minutes on 2 cores; `["all"]` tries every
supported mode (inductor compiles for about a minute per worker on 2 cores).
"""

from __future__ import annotations

from collections.abc import Sequence

from packrat.profile.probe import Capabilities

PRECISIONS = ("fp32", "bf16", "int8", "int8s")
INT8S_RUNTIMES = ("onnxruntime", "openvino")
RUNTIMES = ("eager", "torchscript", "inductor", "onnxruntime", "openvino", "ipex")
ALL = "all"

# Tried by default, in this order after the archive's own mode: two per task, so
# that all demo models are tuned within ~15 min on 2 cores. From
# docs/modes-benchmark.md (2-core Xeon with AMX and 2-core EPYC with avx512_bf16):
# encoders: bf16-openvino 4-5x, int8-onnxruntime ~3x over fp32 eager (fp32
# OpenVINO/ONNX Runtime ~1.1x); ResNet-50: bf16-openvino 5-8x, bf16-torchscript
# ~3x (fp32 runtimes 1.3x); GPT-2 runs eager only, so only the precision varies.
# int8s-openvino (int8-static through NNCF): on the 2-core EPYC (VNNI, no AMX),
# through TorchServe at B=8, ResNet-50 1.82x and BERT-base 1.74x bf16-openvino's
# throughput (docs/modes-benchmark.md, "int8-static"); offered only with VNNI/AMX
# int8 and nncf importable.
SHORTLIST: dict[str, tuple[str, ...]] = {
    "text-classification": ("bf16-openvino", "int8-onnxruntime", "int8s-openvino"),
    "feature-extraction": ("bf16-openvino", "int8-onnxruntime", "int8s-openvino"),
    "image-classification": ("bf16-openvino", "bf16-torchscript", "int8s-openvino"),
    "text-generation": ("bf16-eager", "int8-eager"),
    "noop": (),  # no model: only the shape is tuned
}


def unsupported(mode: str, caps: Capabilities) -> str | None:
    """Why `mode` cannot run for this archive on this machine, or None."""
    precision, sep, runtime = mode.partition("-")
    if not sep or precision not in PRECISIONS or runtime not in RUNTIMES:
        return f"unknown mode (precisions {', '.join(PRECISIONS)}; runtimes {', '.join(RUNTIMES)})"
    if caps.task == "noop" and mode != caps.mode:
        return "the noop task has no model to run in another mode"
    if precision == "int8s":
        why = _int8s_unsupported(runtime, caps)
        if why:
            return why
    if caps.task == "text-generation" and runtime != "eager":
        return "text-generation runs eager only (the decoding loop is not traced or exported)"
    if precision == "bf16" and caps.bf16:
        return caps.bf16
    if runtime in caps.unavailable:
        return caps.unavailable[runtime]
    if runtime not in caps.runtimes:
        return f"runtime {runtime!r} is not offered by this archive's handler"
    if precision == "bf16" and runtime == "onnxruntime":
        return "ONNX Runtime's CPU provider has no bf16 kernels for these graphs"
    if precision == "int8" and runtime in ("inductor", "ipex"):
        return f"int8 is not offered with {runtime}"
    return None


def _int8s_unsupported(runtime: str, caps: Capabilities) -> str | None:
    if caps.task == "text-generation":
        return ("int8-static is refused for text-generation: the decoding loop is not exported, and "
                "calibrated activation ranges do not bound later tokens (docs/modes.md)")
    if runtime not in INT8S_RUNTIMES:
        return f"int8-static runs on {' and '.join(INT8S_RUNTIMES)} only"
    if caps.int8:
        return caps.int8
    return caps.unavailable.get(f"int8s-{runtime}")


def every_mode() -> list[str]:
    return [f"{p}-{r}" for r in RUNTIMES for p in PRECISIONS]


def candidate_modes(caps: Capabilities, requested: Sequence[str] | None = None
                    ) -> tuple[list[str], dict[str, str]]:
    """(modes to try, the archive's own first; {mode: why it is not tried})."""
    if requested:
        wanted = [m.strip().lower() for m in requested if m.strip()]
        if ALL in wanted:
            wanted = every_mode()
    else:
        wanted = list(SHORTLIST.get(caps.task or "", ()))
    out: list[str] = [caps.mode]
    skipped: dict[str, str] = {}
    for mode in wanted:
        if mode in out or mode in skipped:
            continue
        why = unsupported(mode, caps)
        if why:
            skipped[mode] = why
        else:
            out.append(mode)
    return out, skipped

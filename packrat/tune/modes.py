"""Which execution modes to try for an archive on this machine (pure: no torch, no I/O).

    candidate_modes(caps, requested=None) -> (modes to try, {mode: why not})

A mode is "<precision>-<runtime>" (docs/modes.md). It is a candidate when the
machine supports it (packrat.profile.probe.Capabilities: bf16 and bf16w only
with native bf16, a runtime only where it imports) and the task can run it
(text-generation: eager only; no bf16 on ONNX Runtime; bf16w on eager only;
no int8 on inductor or IPEX; int8s — int8-static, calibrated — only on ONNX
Runtime and OpenVINO, with its quantisation tool importable, on a CPU with
SIMD int8 multiply-add (VNNI, AMX or AVX2), and never for text-generation). The archive's own mode always comes first: it is what serves until
a mode more than 3 % faster is found (packrat.plan.MODE_MARGIN), and it wins within that.

Without `requested`, the candidates are a short list per task — the modes
that were fastest in the measurements of docs/modes-benchmark.md — so that
tuning every demo model fits in minutes on 2 cores; `["all"]` tries every
supported mode (inductor compiles for about a minute per worker on 2 cores).

    fallback_modes(caps, candidates, skipped) -> fp32 graph modes for bf16 ones refused

On a CPU without native bf16 the short list's bf16 graph modes are refused, and with them the
graph runtime's own gain; the tune then tries their fp32 counterparts (fp32-openvino,
fp32-torchscript) when no other candidate could be measured (every int8 mode refused by the
accuracy guard, say), so that such a model does not stay in eager for want of a mode. They are
not tried otherwise: each would take a share of the tune's budget from the int8 modes, which
were as fast or faster wherever both were measured (modes-avx2-epyc.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from packrat.modes import (
    BF16_PRECISIONS,
    ExecutionMode,
    every_mode,
    int8s_runtime_refusal,
    int8s_task_refusal,
    pairing_refusal,
    task_refusal,
)
from packrat.profile.probe import Capabilities

ALL = "all"

# Tried by default, in this order after the archive's own mode: two per task, so
# that all demo models are tuned within ~15 min on 2 cores. From
# docs/modes-benchmark.md (2-core Xeon with AMX and 2-core EPYC with avx512_bf16):
# encoders: bf16-openvino 4-5x, int8-onnxruntime ~3x over fp32 eager (fp32
# OpenVINO/ONNX Runtime ~1.1x); ResNet-50: bf16-openvino 5-8x, bf16-torchscript
# ~3x (fp32 runtimes 1.3x); GPT-2 runs eager only, so only the precision varies:
# bf16w (bf16 weights), not bf16 autocast, which re-casts the fp32 weights on every
# call of the decoding loop: batch 8 x 20 tokens on the AMX Xeon took 1.35-1.41 s in
# fp32, 1.95-2.01 s under autocast, 0.63 s with bf16 weights (issue 35); on the EPYC
# see docs/benchmarks/gen-bf16w-epyc.md. bf16-eager is still tried on request.
# int8s-openvino (int8-static through NNCF): on the 2-core EPYC (VNNI, no AMX),
# through TorchServe at B=8, ResNet-50 1.82x and BERT-base 1.74x bf16-openvino's
# throughput (docs/modes-benchmark.md, "int8-static"); on a Zen 3 EPYC with AVX2 and
# no VNNI, ResNet-50 2.5x fp32 eager, BERT-base no faster than fp32-openvino
# (docs/benchmarks/modes-avx2-epyc.md); offered with VNNI, AMX or AVX2 int8 and nncf importable.
SHORTLIST: dict[str, tuple[str, ...]] = {
    "text-classification": ("bf16-openvino", "int8-onnxruntime", "int8s-openvino"),
    "feature-extraction": ("bf16-openvino", "int8-onnxruntime", "int8s-openvino"),
    "image-classification": ("bf16-openvino", "bf16-torchscript", "int8s-openvino"),
    "text-generation": ("bf16w-eager", "int8-eager"),
    "noop": (),  # no model: only the shape is tuned
}


# Measured on the Zen 3 EPYC without bf16 (docs/benchmarks/modes-avx2-epyc.md): ResNet-50
# fp32-openvino 1.3x fp32 eager at batch 4; int8s-openvino 2.5x.
FALLBACK_RUNTIMES = ("openvino", "torchscript")


def fallback_modes(caps: Capabilities, candidates: Sequence[str], skipped: dict[str, str]) -> list[str]:
    """fp32 on the runtime of each skipped bf16 mode that was refused for want of native bf16
    (caps.bf16), where this machine and archive run it and it is not a candidate already."""
    out: list[str] = []
    for mode, why in skipped.items():
        try:
            parsed = ExecutionMode.parse(mode)
        except ValueError:
            continue
        if parsed.precision not in BF16_PRECISIONS or not caps.bf16 or why != caps.bf16:
            continue
        if parsed.runtime not in FALLBACK_RUNTIMES:
            continue
        alt = str(ExecutionMode("fp32", parsed.runtime))
        if alt not in candidates and alt not in out and unsupported(alt, caps) is None:
            out.append(alt)
    return out


def unsupported(mode: str, caps: Capabilities) -> str | None:
    """Why `mode` cannot run for this archive on this machine, or None."""
    try:
        parsed = ExecutionMode.parse(mode)
    except ValueError:
        parsed = ExecutionMode("", "")
    why = parsed.unknown()
    if why:
        return why
    if caps.task == "noop" and mode != caps.mode:
        return "the noop task has no model to run in another mode"
    if parsed.precision == "int8s":
        why = _int8s_unsupported(parsed.runtime, caps)
        if why:
            return why
    why = task_refusal(caps.task, parsed.runtime)
    if why:
        return why
    if parsed.precision in BF16_PRECISIONS and caps.bf16:
        return caps.bf16
    if parsed.runtime in caps.unavailable:
        return caps.unavailable[parsed.runtime]
    if parsed.runtime not in caps.runtimes:
        return f"runtime {parsed.runtime!r} is not offered by this archive's handler"
    return pairing_refusal(parsed)


def _int8s_unsupported(runtime: str, caps: Capabilities) -> str | None:
    why = int8s_task_refusal(caps.task) or int8s_runtime_refusal(runtime)
    if why:
        return why
    if caps.int8:
        return caps.int8
    return caps.unavailable.get(f"int8s-{runtime}")


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

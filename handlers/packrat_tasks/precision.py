"""Numeric precision of a model path: `packrat.precision` = fp32 | bf16 | bf16w | int8 | int8s.

    fp32  the weights as trained.
    bf16  torch: autocast to bfloat16 (matmuls and convolutions in bf16 through
          oneDNN, softmax/layer norm kept in fp32); OpenVINO: its bf16
          inference precision. Refused where the CPU has no native bf16
          (avx512_bf16 or AMX): there bf16 is emulated and slower than fp32.
    bf16w eager only: the weights themselves cast to bf16 (half the bytes each
          matmul reads, no cast per call), layer norms kept in fp32; the
          attention softmax runs in torch's scaled_dot_product_attention, whose
          CPU kernel accumulates bf16 in fp32. Autocast re-casts fp32 weights
          on every call: for GPT-2's decoding loop (many small matmuls) that
          made bf16 slower than fp32 on an AMX Xeon, bf16w 2.2x faster
          (docs/modes.md). Needs native bf16 as bf16 does.
    int8  torch: dynamic quantisation of every nn.Linear (int8 weights, int8
          activations quantised per batch; convolutions stay fp32; GPT-2's
          Conv1D projections are first swapped for equivalent Linears);
          ONNX Runtime / OpenVINO: ONNX Runtime's dynamic int8 quantisation
          of the exported graph (MatMul/Gemm, per-channel weights), which both
          runtimes execute. Why most int8 modes miss the guard's defaults on
          real MiniLM weights: docs/benchmarks/guard-int8-epyc.md.
    int8s int8-static: post-training static quantisation with calibration from
          the archive (quantize_static.py): convolutions and matmuls with their
          activations in int8. ONNX Runtime / OpenVINO only; refused for the
          torch runtimes and for text-generation. Fast where the CPU has int8
          multiply-add (VNNI or AMX; with AVX2 alone it measured faster for ResNet-50,
          not BERT-base: see int8_static_problem).

Nothing here runs at import time; torch is imported by the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# The names, the CPU flags and what they allow are packrat.modes' (stdlib only, shared with
# the tuner and the archive builder); re-exported here for the archive's own callers
# (packrat.profile.probe reads cpu_flags and int8_static_problem from this module).
from packrat.modes import (  # noqa: F401
    BF16_PRECISIONS,
    PRECISIONS,
    ExecutionMode,
    bf16_problem,
    cpu_flags,
    int8_static_problem,
    pairing_refusal,
)

if TYPE_CHECKING:
    import torch


class PrecisionError(ValueError):
    """The configured precision cannot run (on this CPU, or with this runtime)."""


def precision_name(config: dict[str, Any]) -> str:
    mode = ExecutionMode.from_config(config)
    if mode.precision not in PRECISIONS:
        raise PrecisionError(f"unknown packrat.precision {mode.precision!r}; known: {', '.join(PRECISIONS)}")
    if mode.precision == "bf16w" and (why := pairing_refusal(mode)):
        # Here, not in each runtime: a graph runtime that does not know bf16w would
        # otherwise run it as fp32 under the bf16w name.
        raise PrecisionError(f"{mode} is not offered: {why}")
    return mode.precision


def check_bf16(precision: str = "bf16") -> None:
    """Raise PrecisionError when this machine cannot run `precision` (bf16, bf16w) natively."""
    import torch

    mkldnn = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    problem = bf16_problem(cpu_flags(), mkldnn, precision)
    if problem:
        raise PrecisionError(problem)


def autocast_context(precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context every forward pass of a torch runtime runs in."""
    import torch

    if precision == "bf16":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def quantize_int8(module: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantisation of every nn.Linear; returns a new module (the input is kept).

    torch.ao.quantization is deprecated in favour of torchao (not installed here)
    but still works in torch 2.13; its deprecation warning is silenced.
    """
    import copy
    import warnings

    import torch

    module = _conv1d_to_linear(copy.deepcopy(module))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            module, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
        )


def bf16_weights(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` with its weights and buffers in bf16, its layer norms in fp32
    (the input is kept: the accuracy guard's fp32 reference may run after this).

    A norm's statistics over a whole hidden vector are where bf16's 8-bit mantissa
    loses most, and they cost little: torch's CPU layer_norm takes a bf16 input
    with fp32 weights and computes in fp32. Inputs that are floating point (pixels)
    must be cast to bf16 by the caller (runtimes/eager.py).
    """
    import copy

    import torch

    module = copy.deepcopy(module).to(torch.bfloat16)
    for child in module.modules():
        if isinstance(child, torch.nn.LayerNorm):
            child.float()
    return module


def bf16_weights_info(module: torch.nn.Module) -> dict[str, Any]:
    """What a bf16w module keeps in fp32 and how its attention runs (the worker's summary)."""
    import torch

    norms = sum(isinstance(m, torch.nn.LayerNorm) for m in module.modules())
    out: dict[str, Any] = {"fp32_modules": f"LayerNorm x{norms}"}
    if any("Attention" in type(m).__name__ for m in module.modules()):
        # The HF model's config (a task's wrapper module holds the model inside it).
        config = next((m.config for m in module.modules() if hasattr(m, "config")), None)
        out["attention"] = getattr(config, "_attn_implementation", None)  # "sdpa": fp32 accumulation
    return out


def _conv1d_to_linear(module: torch.nn.Module) -> torch.nn.Module:
    """GPT-2's projections are transformers' Conv1D (y = x @ W + b, W of shape in x out),
    which quantize_dynamic does not know; swap each for the equivalent nn.Linear (W.T)
    so int8 reaches them, not only the LM head."""
    import torch

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "Conv1D" and getattr(child, "weight", None) is not None \
                    and child.weight.dim() == 2:
                n_in, n_out = child.weight.shape
                linear = torch.nn.Linear(n_in, n_out, bias=child.bias is not None)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return module


def prepare_torch(
    module: torch.nn.Module, precision: str
) -> tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager]]:
    """(module to run, context factory) for the torch runtimes (eager/torchscript/inductor)."""
    if precision in BF16_PRECISIONS:
        check_bf16(precision)
    if precision == "int8s":
        raise PrecisionError("int8-static (int8s) is offered with the onnxruntime and openvino "
                             "runtimes only (calibrated int8 graphs); text-generation refuses it "
                             "(docs/modes.md). Use int8 for dynamic quantisation on torch runtimes.")
    if precision == "int8":
        return quantize_int8(module), autocast_context("fp32")
    if precision == "bf16w":
        return bf16_weights(module), autocast_context("fp32")
    return module, autocast_context(precision)

"""The module as an ONNX file: what the ONNX Runtime and OpenVINO runtimes (and int8s) start from."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def export_onnx(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], directory: str,
                precision: str) -> str:
    """The module as an ONNX file in `directory` (batch and sequence axes dynamic).

    torch 2.13's default exporter is the dynamo one (needs onnxscript);
    dynamo=False selects the TorchScript-based exporter, which needs only `onnx`.
    int8: ONNX Runtime's dynamic quantisation of MatMul/Gemm weights, per output channel
    (per tensor, all-MiniLM-L6-v2's embeddings kept min row cosine 0.945 with fp32,
    per channel 0.989; no slower: docs/benchmarks/guard-int8-epyc.md).
    """
    import warnings

    import torch

    names = [f"input_{i}" for i in range(len(example_inputs))]
    axes: dict[str, dict[int, str]] = {}
    for n, t in zip(names, example_inputs):
        axes[n] = {0: "batch"}
        if t.dim() == 2:  # token ids / masks: variable sequence length
            axes[n][1] = "sequence"
    axes["output"] = {0: "batch"}
    path = os.path.join(directory, "model.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example_inputs, path, dynamo=False, input_names=names,
                          output_names=["output"], dynamic_axes=axes, opset_version=17)
    if precision == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = os.path.join(directory, "model.int8.onnx")
        quantize_dynamic(path, quantized, weight_type=QuantType.QInt8, per_channel=True)
        return quantized
    return path

"""The one seam between a model and how it runs: (module, config) -> callable.

Tasks wrap their HF model in a small nn.Module that takes positional tensors
and returns one tensor, then ask make_runner() for a callable with the same
signature. New backends (bf16, int8, onnxruntime, openvino, ...) add one
function to RUNTIMES; nothing else changes.

    eager        the module itself under torch.inference_mode()
    torchscript  "graph mode": torch.jit.trace on example inputs, then
                 torch.jit.freeze (weights folded into the graph) and
                 torch.jit.optimize_for_inference (conv/bn folding, oneDNN
                 layouts); tasks pad inputs to fixed shapes for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RUNTIMES: dict[str, Callable[..., Callable[..., Any]]] = {}


def runtime(name: str):
    def register(fn):
        RUNTIMES[name] = fn
        return fn

    return register


def runtime_name(config: dict[str, Any]) -> str:
    return str((config.get("packrat") or {}).get("runtime", "eager")).lower()


def make_runner(module, example_inputs: tuple, config: dict[str, Any]) -> Callable[..., Any]:
    """A callable(*tensors) -> tensor running `module` with the runtime the config names."""
    name = runtime_name(config)
    if name not in RUNTIMES:
        raise ValueError(f"unknown packrat.runtime {name!r}; known: {sorted(RUNTIMES)}")
    module.eval()
    return RUNTIMES[name](module, example_inputs, config)


@runtime("eager")
def _eager(module, example_inputs: tuple, config: dict[str, Any]) -> Callable[..., Any]:
    import torch

    def run(*tensors):
        with torch.inference_mode():
            return module(*tensors)

    return run


@runtime("torchscript")
def _torchscript(module, example_inputs: tuple, config: dict[str, Any]) -> Callable[..., Any]:
    import torch

    with torch.no_grad():
        traced = torch.jit.trace(module, example_inputs, check_trace=False)
        frozen = torch.jit.freeze(traced.eval())
        frozen = torch.jit.optimize_for_inference(frozen)
        # Two warm-up calls: the profiling executor specialises on the first runs.
        for _ in range(2):
            frozen(*example_inputs)

    def run(*tensors):
        with torch.no_grad():
            return frozen(*tensors)

    return run

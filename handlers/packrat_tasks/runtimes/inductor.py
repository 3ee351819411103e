"""packrat.runtime inductor: torch.compile with inductor freezing, the batch dimension dynamic."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from packrat_tasks.precision import PrecisionError, prepare_torch
from packrat_tasks.runtimes.layout import channels_last, nhwc

if TYPE_CHECKING:
    import torch

    from packrat_tasks.runner import Runner


def build(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
          precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import torch

    if precision == "int8":
        raise PrecisionError(
            "int8-inductor is not offered: torch.compile does not lower dynamically quantised "
            "Linear modules (compiling them took minutes and ran them unfused). Use int8-torchscript, "
            "int8-onnxruntime or int8-openvino."
        )
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights become constants: folding, prepacked oneDNN weights
    module, ctx = prepare_torch(module, precision)
    on = channels_last(module, example_inputs)
    runner.info["channels_last"] = on
    compiled = torch.compile(module, backend="inductor")
    # One graph for every batch size: the batch dimension is symbolic, the rest
    # (text padded to max_length, 224x224 images) static. Without this each new
    # batch size recompiles (~1 min on 2 cores) in the middle of serving.
    for t in example_inputs:
        torch._dynamo.mark_dynamic(t, 0)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), ctx():
            return compiled(*nhwc(tensors, on)).float()

    return run

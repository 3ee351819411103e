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
    import torch.fx.experimental._config as fx_config

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        xs = nhwc(tensors, on)
        # One graph for every batch size, 1 included: the batch dimension is symbolic,
        # the rest (text padded to max_length, 224x224 images) static. Marked on the
        # tensors the graph is called with (nhwc() makes new ones for images), and
        # size-oblivious so that dynamo does not specialise it on 0/1: otherwise the
        # first batch of one recompiles after READY (tiny BERT: 6-9 s; any other new
        # batch size ~1 min on 2 cores). Compiles happen inside calls, so the option
        # is on for calls only, not for other compiles in the process.
        for t in xs:
            torch._dynamo.mark_dynamic(t, 0)
        with torch.no_grad(), ctx(), fx_config.patch(backed_size_oblivious=True):
            return compiled(*xs).float()

    return run

"""packrat.runtime eager: the module itself under torch.inference_mode()."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from packrat_tasks.precision import bf16_weights_info, prepare_torch
from packrat_tasks.runtimes.layout import channels_last, nhwc

if TYPE_CHECKING:
    import torch

    from packrat_tasks.runner import Runner


def build(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
          precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import torch

    module, ctx = prepare_torch(module, precision)
    on = channels_last(module, example_inputs)
    runner.info["channels_last"] = on
    # bf16w: the weights are bf16, so floating inputs (pixels) must be too; ids and masks stay.
    cast = torch.bfloat16 if precision == "bf16w" else None
    if cast is not None:
        runner.info["bf16w"] = bf16_weights_info(module)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        tensors = nhwc(tensors, on)
        if cast is not None:
            tensors = tuple(t.to(cast) if t.is_floating_point() else t for t in tensors)
        with torch.inference_mode(), ctx():
            return module(*tensors).float()

    return run

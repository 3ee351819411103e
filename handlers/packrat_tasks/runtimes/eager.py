"""packrat.runtime eager: the module itself under torch.inference_mode()."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from packrat_tasks.precision import prepare_torch
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

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), ctx():
            return module(*nhwc(tensors, on)).float()

    return run

"""packrat.runtime torchscript: torch.jit.trace -> freeze (cached per archive) -> optimize_for_inference."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrat_tasks.precision import prepare_torch
from packrat_tasks.runner import load_cached
from packrat_tasks.runtimes.layout import channels_last, nhwc

if TYPE_CHECKING:
    import torch

    from packrat_tasks.runner import Runner

log = logging.getLogger(__name__)


def build(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
          precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import torch

    module, ctx = prepare_torch(module, precision)
    on = channels_last(module, example_inputs)
    runner.info["channels_last"] = on
    example = nhwc(example_inputs, on)
    built: list[torch.jit.ScriptModule] = []

    def trace_and_freeze(directory: Path | None = None) -> None:
        # Traced and frozen under the same autocast the calls run in, so the graph
        # records the bf16 casts and freezing folds them into bf16 weights.
        with torch.no_grad(), ctx():
            traced = torch.jit.trace(module, example, check_trace=False)
            built.append(torch.jit.freeze(traced.eval()))
        if directory is not None:  # the frozen graph, before the CPU-specific passes below
            torch.jit.save(built[0], str(directory / "frozen.pt"))

    def load(key_dir: Path) -> torch.jit.ScriptModule:
        return built[-1] if built else torch.jit.load(str(key_dir / "frozen.pt"))

    try:  # a cached graph that fails to load is rebuilt once (load_cached)
        frozen = load_cached(runner, "torchscript", trace_and_freeze, load)
    except RuntimeError as exc:  # a graph torch.jit.save cannot serialise: keep the in-memory one
        if not built:
            raise
        log.warning("frozen TorchScript not cached (%s)", exc)
        frozen = None
    if frozen is None:
        if not built:
            trace_and_freeze()
        frozen = built[-1]
    if precision != "int8":  # its passes do not know quantised linear packs
        with torch.no_grad(), ctx():
            frozen = torch.jit.optimize_for_inference(frozen)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), ctx():
            return frozen(*nhwc(tensors, on)).float()

    return run

"""A deliberately wrong execution mode for the accuracy-guard tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from packrat_tasks.runtime import RUNTIMES, runtime  # handlers/: on the path (pyproject's pythonpath)


@contextmanager
def noisy_runtime(name: str) -> Iterator[list[int]]:
    """Register runtime `name`: the right shapes, every output perturbed by noise three
    times its largest value (so every guard refuses it). Yields a list that grows by one
    each time the mode is built; unregisters on exit."""
    built: list[int] = []

    @runtime(name)
    def _noisy(module, example_inputs, config, precision, runner):
        built.append(1)
        gen = torch.Generator().manual_seed(0)

        def run(*tensors):
            with torch.inference_mode():
                out = module(*tensors).float()
            return out + torch.randn(out.shape, generator=gen) * out.abs().max() * 3

        return run

    try:
        yield built
    finally:
        RUNTIMES.pop(name)

"""Channels-last for convolution models (4-D image input): oneDNN's fast layout (NHWC)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def channels_last(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> bool:
    """Convolution models (4-D image input) run NHWC: oneDNN's fast layout."""
    import torch

    if any(getattr(t, "dim", lambda: 0)() == 4 for t in example_inputs):
        module.to(memory_format=torch.channels_last)
        return True
    return False


def nhwc(tensors: tuple[torch.Tensor, ...], on: bool) -> tuple[torch.Tensor, ...]:
    import torch

    if not on:
        return tensors
    return tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in tensors)

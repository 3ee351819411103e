"""packrat.runtime ipex: intel-extension-for-pytorch's optimize + frozen TorchScript.

An optional extra that imports only beside torch 2.8 (docs/modes.md); elsewhere
the mode is refused with the import error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from packrat_tasks.precision import PrecisionError, prepare_torch

if TYPE_CHECKING:
    import torch

    from packrat_tasks.runner import Runner


def build(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
          precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import torch

    try:
        import intel_extension_for_pytorch as ipex  # optional extra; only beside torch 2.8
    except Exception as exc:  # ImportError, or its own version check failing
        raise RuntimeError(
            f"packrat.runtime ipex: intel-extension-for-pytorch is not importable here ({exc}); it "
            f"supports torch 2.8 only (this is torch {torch.__version__}). See docs/modes.md."
        ) from exc
    if precision == "int8":
        raise PrecisionError("int8-ipex is not offered (IPEX int8 needs static calibration)")
    module, ctx = prepare_torch(module, precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    module = ipex.optimize(module, dtype=dtype)
    with torch.no_grad(), ctx():
        frozen = torch.jit.freeze(torch.jit.trace(module, example_inputs, check_trace=False).eval())

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), ctx():
            return frozen(*tensors).float()

    return run

"""packrat.runtime onnxruntime: the exported ONNX graph in an ONNX Runtime CPU session.

ONNX Runtime's intra-op threads are the slot's threads (claim_and_pin() has
pinned the process to the slot's cores), inter-op 1, sequential execution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from packrat_tasks.precision import PrecisionError
from packrat_tasks.runtimes.exported import feeds, load_model_file

if TYPE_CHECKING:
    import torch

    from packrat_tasks.runner import Runner


def build(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
          precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import onnxruntime as ort  # the installed package (absolute import), not this module
    import torch

    if precision == "bf16":
        raise PrecisionError(
            "bf16-onnxruntime is not offered: ONNX Runtime's CPU provider has no bf16 kernels for "
            "these graphs. Use bf16-openvino or bf16 with a torch runtime."
        )
    threads = torch.get_num_threads()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads  # the slot's threads, on the slot's pinned cores
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = load_model_file(module, example_inputs, precision, "onnxruntime", runner,
                              lambda path, _: ort.InferenceSession(path, options,
                                                                   providers=["CPUExecutionProvider"]))
    names = [i.name for i in session.get_inputs()]
    runner.info["onnxruntime"] = {"version": ort.__version__, "intra_op_num_threads": threads,
                                  "inter_op_num_threads": 1}

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        out = session.run(None, dict(zip(names, feeds(tensors))))[0]
        return torch.from_numpy(out)

    return run

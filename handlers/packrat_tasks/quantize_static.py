"""int8-static (`packrat.precision: int8s`): post-training static int8 quantisation with calibration.

Unlike `int8` (dynamic: weights int8, activations quantised per batch, only
Linear/MatMul), int8-static fixes every activation's scale from calibration
data, so convolutions *and* matmuls run int8 x int8 (VNNI/AMX, or AVX2):

    int8s-openvino     NNCF (nncf.quantize) on the exported ONNX graph read as an
                       OpenVINO model; saved as OpenVINO IR (model.xml/.bin).
                       Encoders: model_type TRANSFORMER (softmax, layer norm,
                       GELU and the residual adds stay in floating point; MatMul
                       inputs int8) with SmoothQuant off (see SMOOTH_QUANT).
                       CNNs: NNCF's default (Conv/MatMul inputs int8).
    int8s-onnxruntime  ONNX Runtime's quantize_static, QDQ format, uint8
                       activations x int8 per-channel weights, MinMax
                       calibration, only Conv/MatMul/Gemm quantised.

Both keep the classifier head (the last MatMul/Gemm feeding the output
through shape/bias ops only) in fp32: it is a negligible share of the compute
and the one layer whose error lands unfiltered in the probabilities the guard
bounds. Text-generation is refused (see `generation_refusal`).

Calibration comes from the archive only (nothing is downloaded):
  1. `calibration.jsonl` in the archive root (optional; another name with
     `packrat.calibration_file`): one request body per line, in the task's
     JSON request format ({"text": "..."} or {"image": "<base64 JPEG/PNG>"});
  2. the task's sample request plus varied synthetic inputs of the same
     generators (samples.sample_jpeg with other seeds and sizes than the
     guard's; prefixes of samples.sample_text of several lengths), never the
     accuracy guard's own inputs, so the guard checks inputs it was not
     calibrated on;
up to `packrat.calibration_samples` (default 16) requests, each run through
the task's own preprocess (one request per batch: real sequence lengths).

The quantised model is built once per (archive content, mode, config,
library versions, CPU) through build_cache (via runner.cached_artifact), so
a swap or a restarted worker loads it instead of calibrating again.
runtimes/exported.py calls it; it imports the runner and the ONNX export, never runtime.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrat.modes import INT8S_RUNTIMES
from packrat_tasks.runner import materialize
from packrat_tasks.runtimes.onnx_export import export_onnx

if TYPE_CHECKING:
    import numpy as np
    import torch

    from packrat_tasks.base import Task

log = logging.getLogger(__name__)

RECIPE = "int8s-v2"  # bump when the quantisation settings below change: cache keys include it
# NNCF's TRANSFORMER preset applies SmoothQuant to MatMuls (alpha 0.95). On all-MiniLM-L6-v2
# it cost accuracy: vs fp32, the embedder's min row cosine was 0.915 with it, 0.991 without,
# and a MiniLM classifier's max prob diff 0.24 vs 0.052 (docs/benchmarks/guard-int8-epyc.md);
# no speed difference measured. -1 turns it off.
SMOOTH_QUANT = -1.0
CALIBRATION_FILE = "calibration.jsonl"
DEFAULT_SAMPLES = 16
RUNTIMES = INT8S_RUNTIMES  # the runtimes whose graphs it quantises
IR_FILE = "model.xml"
QDQ_FILE = "model.int8s.onnx"
# Ops between the classifier head and the graph output that do not compute (ONNX and OpenVINO names).
_PASSTHROUGH = {"Add", "Reshape", "Flatten", "Squeeze", "Identity", "Cast", "Convert", "Result"}
_HEAD_OPS = {"Gemm", "MatMul"}

Calibration = list[tuple["np.ndarray", ...]]


def generation_refusal() -> str:
    return ("int8-static (int8s) is refused for text-generation: the greedy decoding loop runs eager "
            "with a growing KV cache and is not exported, so there is no graph to calibrate; and "
            "fixed activation ranges from a few prompts do not bound the logits of later positions, "
            "where one flipped token changes every token after it (int8 dynamic already fails the "
            "generation guard on GPT-2).")


# -- calibration data ----------------------------------------------------------


def _settings(config: dict[str, Any]) -> tuple[str, int]:
    section = config.get("packrat") or {}
    name = str(section.get("calibration_file", CALIBRATION_FILE))
    samples = int(section.get("calibration_samples", DEFAULT_SAMPLES))
    if samples < 1:
        raise ValueError(f"packrat.calibration_samples must be >= 1, got {samples}")
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise ValueError(f"packrat.calibration_file must be a path inside the archive, got {name!r}")
    return name, samples


def file_requests(model_dir: str, name: str) -> list[dict]:
    """The archive's calibration file as request items (one JSON body per non-empty line)."""
    path = Path(model_dir) / name
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{name} line {n}: not a JSON request body ({exc})") from None
        out.append({"body": line.encode("utf-8")})
    return out


def builtin_requests(task: Task, n: int) -> list[dict]:
    """The task's sample request plus varied inputs from the same generators (not the guard's)."""
    out = list(task.sample_requests(1))
    if task.name == "image-classification":
        from packrat_tasks.samples import sample_jpeg

        sizes = ((320, 240), (256, 256), (300, 400), (480, 270), (224, 224))
        # Seeds from 1: the guard uses 100 + i.
        out += [{"body": sample_jpeg(*sizes[i % len(sizes)], seed=1 + i)} for i in range(n)]
    elif task.name in ("text-classification", "feature-extraction"):
        from packrat_tasks.samples import sample_text

        top = int(task.max_length)
        lengths = sorted({max(4, top * k // n) for k in range(1, n + 1)}, reverse=True)
        out += [{"body": sample_text(task.tokenizer, L).encode("utf-8")} for L in lengths]
    seen: set[bytes] = set()
    unique = []
    for r in out:
        if r["body"] not in seen:
            seen.add(r["body"])
            unique.append(r)
    return unique[:n]


def calibration_requests(task: Task, config: dict[str, Any]) -> list[dict]:
    name, samples = _settings(config)
    own = file_requests(task.model_dir, name)
    return (own + builtin_requests(task, samples))[:samples]


def calibration_inputs(task: Task, config: dict[str, Any]) -> Calibration:
    """The model inputs (numpy, one request per entry) the task's preprocess makes of the
    calibration requests: captured by standing in for task.runner during forward()."""
    import torch

    requests = calibration_requests(task, config)
    captured: Calibration = []

    def capture(*tensors: torch.Tensor) -> torch.Tensor:
        captured.append(tuple(t.detach().contiguous().numpy().copy() for t in tensors))
        return torch.zeros(tensors[0].shape[0], 1)

    saved = task.runner
    task.runner = capture
    try:
        for request in requests:
            batch = task.preprocess([request])
            if batch.valid:
                task.forward(batch)
            else:
                log.warning("int8s calibration: the task refused a calibration request: %s", batch.errors)
    finally:
        task.runner = saved
    if not captured:
        raise ValueError("int8s: no calibration input survived the task's preprocess")
    return captured


def calibration_source(task: Task, config: dict[str, Any]) -> Callable[[], Calibration]:
    """A thunk: calibration data is made only on a cache miss."""
    return lambda: calibration_inputs(task, config)


# -- the classifier head ---------------------------------------------------------


def onnx_head(model: Any) -> list[str]:
    """Name of the last Gemm/MatMul that feeds the graph output through passthrough ops, if any."""
    graph = model.graph
    producers = {o: node for node in graph.node for o in node.output}
    node = producers.get(graph.output[0].name)
    while node is not None:
        if node.op_type in _HEAD_OPS:
            return [node.name]
        if node.op_type not in _PASSTHROUGH:
            return []
        inputs = [producers[i] for i in node.input if i in producers and producers[i].op_type != "Constant"]
        inputs.sort(key=lambda n: n.op_type not in _HEAD_OPS)
        node = inputs[0] if inputs else None
    return []


def openvino_head(model: Any) -> list[str]:
    """The same for an OpenVINO model (ONNX Gemm becomes MatMul, Multiply by alpha/beta, Add)."""
    node = model.outputs[0].get_node()
    while node is not None:
        kind = node.get_type_name()
        if kind in _HEAD_OPS:
            return [node.get_friendly_name()]
        inputs_kinds = [v.get_node().get_type_name() for v in node.input_values()]
        # Gemm's alpha/beta arrive as a Multiply by a constant: still no computation of its own.
        scaled = kind == "Multiply" and "Constant" in inputs_kinds
        if kind not in _PASSTHROUGH and not scaled:
            return []
        inputs = [v.get_node() for v in node.input_values() if v.get_node().get_type_name() != "Constant"]
        inputs.sort(key=lambda n: n.get_type_name() not in _HEAD_OPS)
        node = inputs[0] if inputs else None
    return []


def _is_transformer(example_inputs: tuple[torch.Tensor, ...]) -> bool:
    import torch

    return any(t.dtype in (torch.int64, torch.int32) for t in example_inputs)


# -- building ----------------------------------------------------------------------


def build_openvino(onnx_path: str, calibration: Calibration, transformer: bool, out_dir: Path) -> dict:
    """NNCF-quantise the ONNX file; write OpenVINO IR into out_dir; return what was done."""
    os.environ.setdefault("NNCF_CI", "1")  # NNCF's telemetry would try to send usage data: off
    import nncf
    import openvino as ov

    t0 = time.perf_counter()
    model = ov.Core().read_model(onnx_path)
    head = openvino_head(model)
    kwargs: dict[str, Any] = {"subset_size": len(calibration)}
    if transformer:
        from nncf.quantization.advanced_parameters import (
            AdvancedQuantizationParameters,
            AdvancedSmoothQuantParameters,
        )

        kwargs["model_type"] = nncf.ModelType.TRANSFORMER
        kwargs["advanced_parameters"] = AdvancedQuantizationParameters(
            smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=SMOOTH_QUANT))
    if head:
        kwargs["ignored_scope"] = nncf.IgnoredScope(names=head)
    quantized = nncf.quantize(model, nncf.Dataset([list(x) for x in calibration]), **kwargs)
    ov.save_model(quantized, str(out_dir / IR_FILE), compress_to_fp16=False)
    return {"tool": f"nncf {nncf.__version__}", "fp32_ops": head,
            "model_type": "transformer" if transformer else "default",
            "smooth_quant": SMOOTH_QUANT if transformer else None,
            "calibration_inputs": len(calibration), "quantize_s": round(time.perf_counter() - t0, 3)}


class _Reader:
    """onnxruntime.quantization.CalibrationDataReader over the calibration inputs."""

    def __init__(self, names: list[str], calibration: Calibration) -> None:
        self._items = [dict(zip(names, x)) for x in calibration]
        self._it = iter(self._items)

    def get_next(self) -> dict | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._items)


def build_onnxruntime(onnx_path: str, calibration: Calibration, out_dir: Path) -> dict:
    """ONNX Runtime QDQ static quantisation into out_dir/QDQ_FILE; return what was done."""
    import onnx
    import onnxruntime
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    t0 = time.perf_counter()
    pre = str(out_dir / "pre.onnx")
    quant_pre_process(onnx_path, pre, skip_symbolic_shape=True)  # shape inference + graph fusions first
    model = onnx.load(pre)
    head = onnx_head(model)
    names = [i.name for i in model.graph.input]
    del model
    quantize_static(pre, str(out_dir / QDQ_FILE), _Reader(names, calibration),
                    quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, per_channel=True,
                    op_types_to_quantize=["Conv", "MatMul", "Gemm"], nodes_to_exclude=head,
                    calibrate_method=CalibrationMethod.MinMax)
    os.remove(pre)
    return {"tool": f"onnxruntime {onnxruntime.__version__} quantize_static (QDQ, U8S8, per-channel)",
            "fp32_ops": head, "calibration_inputs": len(calibration),
            "quantize_s": round(time.perf_counter() - t0, 3)}


def quantized_model(runtime: str, module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...],
                    calibration: Callable[[], Calibration] | None,
                    cache: Callable[[str, Callable[[Path], None]], Path | None],
                    scratch: str) -> tuple[str, dict]:
    """(path of the int8s model for `runtime`, build record).

    `cache(what, build)` is runner.cached_artifact bound to the runner (None when
    there is no archive or the cache is unusable: then the model is built into
    `scratch`, a temporary directory the caller removes once the model is loaded).
    """
    import tempfile

    if calibration is None:
        raise ValueError("int8s needs calibration data: build it through build_runner (a task)")
    filename = IR_FILE if runtime == "openvino" else QDQ_FILE
    record: dict[str, Any] = {}

    def build(directory: Path) -> None:
        data = calibration()
        with tempfile.TemporaryDirectory(prefix="packrat-int8s-") as tmp:
            # A LazyModule (runtime.model_needed) is made only here, on a cache miss.
            fp32 = export_onnx(materialize(module), example_inputs, tmp, "fp32")
            if runtime == "openvino":
                record.update(build_openvino(fp32, data, _is_transformer(example_inputs), directory))
            else:
                record.update(build_onnxruntime(fp32, data, directory))
        (directory / "int8s.json").write_text(json.dumps(record, sort_keys=True))
        log.info("int8s %s built: %s", runtime, record)

    key_dir = cache(RECIPE, build)
    if key_dir is None:
        directory = Path(scratch)
        build(directory)
        return str(directory / filename), {**record, "cache": "off"}
    if not record:  # a hit: the record of the build that made it
        record = json.loads((key_dir / "int8s.json").read_text())
        record["cache"] = "hit"
    else:
        record["cache"] = "built"
    return str(key_dir / filename), record


__all__ = ["CALIBRATION_FILE", "DEFAULT_SAMPLES", "RECIPE", "RUNTIMES", "build_onnxruntime",
           "build_openvino", "builtin_requests", "calibration_inputs", "calibration_requests",
           "calibration_source", "file_requests", "generation_refusal", "onnx_head", "openvino_head",
           "quantized_model"]

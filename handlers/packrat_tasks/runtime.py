"""The one seam between a model and how it runs: (module, config) -> Runner.

Tasks wrap their HF model in a small nn.Module that takes positional tensors
and returns one tensor, then call build_runner() (or make_runner()) for a
callable with the same signature. The execution *mode* is
`<packrat.precision>-<packrat.runtime>` from model_config.yaml
(packrat.modes.ExecutionMode):

    precision  fp32 | bf16 | bf16w | int8 | int8s  (see precision.py, quantize_static.py)
    runtime    eager | torchscript | inductor | onnxruntime | openvino | ipex
               (one module each under runtimes/, registered in RUNTIMES below)

Every runtime honours the thread count of the worker's slot: claim_and_pin()
has already pinned the process and set torch's intra-op threads, and the
foreign runtimes get the same number (ONNX Runtime intra-op = slot threads,
inter-op 1; OpenVINO INFERENCE_NUM_THREADS = slot threads, pinning on, one
stream, latency hint, inference precision set explicitly — OpenVINO's CPU
default is bf16 on CPUs that have it). Convolution models run channels-last
(oneDNN's preferred layout).

build_runner() is what a task calls in initialize(): fixed guard inputs go
through fp32 eager first (the reference), then the mode is built and warmed
up (so the first request is not slow: compile time is paid before READY),
then the accuracy guard compares the two (guard.py) and refuses the mode
with the numbers if they disagree. Build time and memory are recorded on
the Runner and logged. Text-generation builds its mode in generation.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from packrat import modes
from packrat_tasks import build_cache, guard, quantize_static
from packrat_tasks.precision import PRECISIONS, precision_name
from packrat_tasks.runner import (
    LazyModule,
    Runner,
    artifact_key_dir,
    eager_reference,
    materialize,
    memory_mb,
    mode_name,
    runtime_name,
)
from packrat_tasks.runtimes import eager, inductor, ipex, onnxruntime, openvino, torchscript
from packrat_tasks.runtimes.onnx_export import export_onnx
from packrat_tasks.runtimes.openvino import openvino_properties

if TYPE_CHECKING:
    import torch

    from packrat_tasks.base import Task

log = logging.getLogger(__name__)

# packrat.runtime -> its builder (runtimes/*.py), in packrat.modes.RUNTIMES' order.
RUNTIMES: dict[str, Callable[..., Callable[..., Any]]] = {
    name: backend.build for name, backend in zip(
        modes.RUNTIMES, (eager, torchscript, inductor, onnxruntime, openvino, ipex))
}
# Runtimes that accept any input shape: text is not padded to max_length for them.
DYNAMIC_SHAPES = {"eager", "onnxruntime", "openvino"}

_Builder = TypeVar("_Builder", bound=Callable[..., Callable[..., Any]])


def runtime(name: str) -> Callable[[_Builder], _Builder]:
    """Register a builder under `name` (tests add deliberately wrong runtimes this way)."""
    def register(fn: _Builder) -> _Builder:
        RUNTIMES[name] = fn
        return fn

    return register


def needs_fixed_shapes(config: dict[str, Any]) -> bool:
    """True when the runtime runs a graph specialised to the example's shapes (text: pad)."""
    return runtime_name(config) not in DYNAMIC_SHAPES


def make_runner(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...],
                config: dict[str, Any], model_dir: str | None = None,
                calibration: Callable[[], Any] | None = None,
                warmup_inputs: tuple[torch.Tensor, ...] | None = None) -> Runner:
    """A warmed-up Runner for `module` in the configured mode (no accuracy guard).

    `model_dir`: the archive, so what the mode builds is cached per archive
    content (build_cache.py); None builds without the cache. `warmup_inputs`:
    a small input for the eager runtime's warm-up (default: the example's
    first row); every other runtime warms up on the example it was built for.
    """
    import torch

    name = runtime_name(config)
    precision = precision_name(config)
    if name not in RUNTIMES:
        raise ValueError(f"unknown packrat.runtime {name!r}; known: {sorted(RUNTIMES)}")
    if (name, precision) not in LAZY_MODES:
        module = materialize(module)  # every other builder works on the module itself
    if not isinstance(module, LazyModule):
        module.eval()
    rss0, _ = memory_mb()
    t0 = time.perf_counter()
    runner = Runner(fn=None, mode=str(modes.ExecutionMode(precision, name)), threads=torch.get_num_threads(),
                    model_dir=model_dir, config=config, calibration=calibration)
    runner.fn = RUNTIMES[name](module, example_inputs, config, precision, runner)
    t1 = time.perf_counter()
    # Warm-up before READY: compiles (inductor), specialises (TorchScript's
    # profiling executor needs two runs) and allocates (all runtimes: one run).
    warm = example_inputs
    if name == "eager":
        # Eager specialises nothing: one small call does what its warm-up is for (thread
        # pool, allocator, lazy init). The full example cost a BERT-base swap 2 s under load;
        # after a small call the first full batch took 5-11 % over steady (measured in process).
        warm = warmup_inputs or tuple(t[:1] for t in example_inputs)
    for _ in range(WARMUP_CALLS.get(name, 1)):
        runner.fn(*warm)
    if name == "inductor" and warm[0].shape[0] > 1:
        # A batch of one too: text runs it on the same graph (the batch dimension is not
        # specialised on 1), but convolutions' shape rules guard batch >= 2, so images
        # compile a second graph here, before READY, not on the first single request.
        # Fresh tensors, not views: dynamo guards a view's base, which served inputs lack.
        runner.fn(*(t[:1].clone() for t in warm))
    t2 = time.perf_counter()
    runner.phases_s["mode_build"] = round(t1 - t0, 3)
    runner.phases_s["warmup"] = round(t2 - t1, 3)
    runner.build_s = round(t2 - t0, 3)
    rss, peak = memory_mb()
    runner.rss_mb, runner.peak_rss_mb = round(rss, 1), round(peak, 1)
    runner.rss_delta_mb = round(rss - rss0, 1)
    return runner


# Warm-up calls per runtime before READY: graph runtimes specialise on their second
# call; the others only allocate, which one call does (BERT-base eager: 0.6 s a call).
WARMUP_CALLS = {"torchscript": 2, "inductor": 2, "ipex": 2}

# (runtime, precision) whose builder touches the module only to export it: with the
# exported file in the build cache, such a worker never needs the framework model.
LAZY_MODES = {(r, p) for r in modes.INT8S_RUNTIMES for p in PRECISIONS}


def framework_model(load: Callable[[], Any], wrap: Callable[[Any], torch.nn.Module],
                    model_dir: str | None, config: dict[str, Any], kind: str) -> tuple[Any, Any]:
    """(the loaded model or None, the module to build the mode from): loaded now unless
    model_needed() says the worker serves from the build cache alone; then a LazyModule
    that loads it only if the cache entry vanished."""
    if model_needed(model_dir, config, kind):
        model = load()
        return model, wrap(model)
    return None, LazyModule(lambda: wrap(load()))


def model_needed(model_dir: str | None, config: dict[str, Any], kind: str) -> bool:
    """False when this worker can build its mode without the framework model: an
    ONNX Runtime/OpenVINO mode whose exported graph and passing guard verdict are in
    the build cache (a refused or missing verdict, or any other mode: True)."""
    if model_dir is None or (runtime_name(config), precision_name(config)) not in LAZY_MODES:
        return True
    try:
        verdict = guard.cached_verdict(model_dir, mode_name(config), kind, config)
        # int8s builds its quantised model under its recipe's name (quantize_static.RECIPE).
        what = quantize_static.RECIPE if precision_name(config) == "int8s" else "onnx"
        onnx = artifact_key_dir(model_dir, config, what)
    except OSError:
        return True
    return verdict is None or not verdict["ok"] or not build_cache.is_complete(onnx)


def _guard_reference(task: Task, module: Any, th: dict[str, float]) -> tuple[Any, torch.Tensor]:
    """(the guard's batch, fp32 eager's outputs on it); leaves task.runner set to fp32 eager."""
    batch = task.preprocess(guard.guard_requests(task, th))
    if not batch.valid:
        raise ValueError(f"accuracy guard: the task refused all its guard inputs: {batch.errors}")
    task.runner = eager_reference(materialize(module))
    return batch, task.forward(batch).outputs.detach().clone()


def build_runner(task: Task, module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...],
                 config: dict[str, Any], kind: str,
                 warmup_inputs: tuple[torch.Tensor, ...] | None = None) -> Runner:
    """make_runner() plus the accuracy guard; sets and returns task.runner.

    `kind` is "classification" or "embedding". The guard's inputs go through
    the task's own preprocess/forward, so padding and masks are those served.
    Raises guard.AccuracyGuardError (with the numbers) when the mode disagrees.
    """
    mode = mode_name(config)
    batch = None
    th = guard.thresholds(config)
    model_dir = getattr(task, "model_dir", None)
    # The verdict is cached per (archive content, mode, config): a mode this archive
    # passed is not re-guarded by every worker, one it failed is refused at once.
    verdict = guard.cached_verdict(model_dir, mode, kind, config) if mode != "fp32-eager" else None
    if verdict is not None and not verdict["ok"]:
        log.info("%s (cached verdict)", verdict["message"])
        guard.enforce(guard.report_of(verdict))
    t0 = time.perf_counter()
    if mode != "fp32-eager" and verdict is None:
        # Reference first: some modes change the module in place (channels-last).
        batch, reference = _guard_reference(task, module, th)
    guard_s = time.perf_counter() - t0
    calibration = None
    if precision_name(config) == "int8s":  # calibrated from the archive's own inputs
        calibration = quantize_static.calibration_source(task, config)
    task.runner = runner = make_runner(module, example_inputs, config, model_dir=model_dir,
                                       calibration=calibration, warmup_inputs=warmup_inputs)
    if verdict is not None and verdict.get("artefacts") != runner.info.get("artefacts", {}):
        # The verdict judged other builds of the cached files (one was damaged and rebuilt,
        # or the verdict predates build ids): judge these.
        log.info("accuracy guard: the cached verdict is for other builds of %s's files; guarding", mode)
        t0 = time.perf_counter()
        batch, reference = _guard_reference(task, module, th)
        task.runner = runner
        guard_s, verdict = time.perf_counter() - t0, None
    if batch is not None:
        t0 = time.perf_counter()
        candidate = task.forward(batch).outputs
        compare = guard.compare_classification if kind == "classification" else guard.compare_embedding
        report = compare(mode, reference, candidate, th)
        runner.guard = report.as_dict()
        runner.info.setdefault("build_cache", {})["guard"] = guard.store_verdict(
            model_dir, mode, kind, config, report, runner.info.get("artefacts"))
        runner.phases_s["guard"] = round(guard_s + time.perf_counter() - t0, 3)
        log.info("%s", report.message)
        guard.enforce(report)
    elif verdict is not None:
        runner.guard = {**verdict, "cached": True}
        runner.info.setdefault("build_cache", {})["guard"] = "hit"
        runner.phases_s["guard"] = 0.0
        log.info("%s (cached verdict)", verdict["message"])
    log.info("packrat mode %s ready: %s", mode, runner.summary())
    return runner


__all__ = [
    "DYNAMIC_SHAPES", "LAZY_MODES", "PRECISIONS", "RUNTIMES", "LazyModule", "Runner", "build_runner",
    "eager_reference", "export_onnx", "framework_model", "make_runner", "materialize", "memory_mb",
    "mode_name", "model_needed", "needs_fixed_shapes", "openvino_properties", "runtime", "runtime_name",
]

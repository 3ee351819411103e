"""The one seam between a model and how it runs: (module, config) -> Runner.

Tasks wrap their HF model in a small nn.Module that takes positional tensors
and returns one tensor, then call build_runner() (or make_runner()) for a
callable with the same signature. The execution *mode* is
`<packrat.precision>-<packrat.runtime>` from model_config.yaml:

    precision  fp32 | bf16 | int8            (see precision.py)
    runtime    eager        the module under torch.inference_mode()
               torchscript  torch.jit.trace -> freeze -> optimize_for_inference
               inductor     torch.compile with inductor freezing, batch dim dynamic
               onnxruntime  legacy ONNX export, ONNX Runtime CPU session
               openvino     the same ONNX graph compiled by OpenVINO's CPU plugin
               ipex         intel-extension-for-pytorch's optimize + TorchScript
                            (optional extra; importable only beside torch 2.8)

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
the Runner and logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from packrat_tasks.precision import PRECISIONS, PrecisionError, precision_name, prepare_torch

if TYPE_CHECKING:
    import numpy as np
    import torch

    from packrat_tasks.base import Task
    from packrat_tasks.generation import TextGenerationTask

log = logging.getLogger(__name__)

RUNTIMES: dict[str, Callable[..., Callable[..., Any]]] = {}
# Runtimes that accept any input shape: text is not padded to max_length for them.
DYNAMIC_SHAPES = {"eager", "onnxruntime", "openvino"}

_Builder = TypeVar("_Builder", bound=Callable[..., Callable[..., Any]])


def runtime(name: str) -> Callable[[_Builder], _Builder]:
    def register(fn: _Builder) -> _Builder:
        RUNTIMES[name] = fn
        return fn

    return register


def runtime_name(config: dict[str, Any]) -> str:
    return str((config.get("packrat") or {}).get("runtime", "eager")).lower()


def mode_name(config: dict[str, Any]) -> str:
    """"<precision>-<runtime>", the same string as the profile fingerprint's mode."""
    return f"{precision_name(config)}-{runtime_name(config)}"


def needs_fixed_shapes(config: dict[str, Any]) -> bool:
    """True when the runtime runs a graph specialised to the example's shapes (text: pad)."""
    return runtime_name(config) not in DYNAMIC_SHAPES


@dataclass
class Runner:
    """A model path ready to serve: call it like the module."""

    fn: Callable[..., Any]
    mode: str
    threads: int
    build_s: float = 0.0  # conversion/compilation + warm-up, seconds
    rss_mb: float = 0.0  # resident memory after building the mode
    rss_delta_mb: float = 0.0  # what building the mode added (graphs, converted weights)
    peak_rss_mb: float = 0.0  # the process's high-water mark so far (export/compile peaks)
    guard: dict[str, Any] | None = None  # GuardReport.as_dict(); None for fp32-eager
    info: dict[str, Any] = field(default_factory=dict)  # runtime details (e.g. OpenVINO properties)
    # Seconds per start-up phase: mode_build, warmup, guard (the worker's status file reports them).
    phases_s: dict[str, float] = field(default_factory=dict)
    # The archive directory (build_cache keys on its content); None: build without the cache.
    model_dir: str | None = None
    config: dict[str, Any] | None = None  # the model_config.yaml the mode was built from
    # int8s: makes the calibration inputs from the task (quantize_static.py); called on a cache miss only.
    calibration: Callable[[], Any] | None = None

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.fn(*tensors)

    def summary(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("mode", "threads", "build_s", "rss_mb", "rss_delta_mb",
                                             "peak_rss_mb")}
        out["guard"] = None if self.guard is None else {
            "ok": self.guard["ok"], "message": self.guard["message"], "metrics": self.guard["metrics"]}
        out.update(self.info)
        return out


def memory_mb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB, from /proc/self/status."""
    rss = peak = 0.0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss, peak


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
    runner = Runner(fn=None, mode=f"{precision}-{name}", threads=torch.get_num_threads(),
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
LAZY_MODES = {(r, p) for r in ("onnxruntime", "openvino") for p in ("fp32", "bf16", "int8", "int8s")}


class LazyModule:
    """A module made on first use (materialize()). A task passes one when
    model_needed() says its worker can serve from the build cache alone: importing
    the framework's model code and reading its weights is most of a worker's start
    (BERT-base: seconds), and an ONNX Runtime or OpenVINO worker whose exported
    graph and guard verdict are cached never runs the module. Should the cache
    entry vanish between the check and the build, the module is made then."""

    def __init__(self, factory: Callable[[], torch.nn.Module]) -> None:
        self._factory = factory
        self._module: torch.nn.Module | None = None

    def get(self) -> torch.nn.Module:
        if self._module is None:
            self._module = self._factory().eval()
        return self._module


def materialize(module: Any) -> torch.nn.Module:
    return module.get() if isinstance(module, LazyModule) else module


def framework_model(load: Callable[[], Any], wrap: Callable[[Any], torch.nn.Module],
                    model_dir: str | None, config: dict[str, Any], kind: str) -> tuple[Any, Any]:
    """(the loaded model or None, the module to build the mode from): loaded now unless
    model_needed() says the worker serves from the build cache alone; then a LazyModule
    that loads it only if the cache entry vanished."""
    if model_needed(model_dir, config, kind):
        model = load()
        return model, wrap(model)
    return None, LazyModule(lambda: wrap(load()))


def _artifact_key_dir(model_dir: str, config: dict[str, Any], what: str,
                      threads: int | None = None) -> Path:
    """The build-cache directory cached_artifact() uses for `what` (one keying, two callers)."""
    from packrat_tasks import build_cache

    return build_cache.artifact_dir(model_dir, mode_name(config), threads,
                                    {"what": what, "config": build_cache.config_digest(config)})


def model_needed(model_dir: str | None, config: dict[str, Any], kind: str) -> bool:
    """False when this worker can build its mode without the framework model: an
    ONNX Runtime/OpenVINO mode whose exported graph and passing guard verdict are in
    the build cache (a refused or missing verdict, or any other mode: True)."""
    from packrat_tasks import build_cache, guard

    if model_dir is None or (runtime_name(config), precision_name(config)) not in LAZY_MODES:
        return True
    try:
        verdict = guard.cached_verdict(model_dir, mode_name(config), kind, config)
        # int8s builds its quantised model under its recipe's name (quantize_static.RECIPE).
        what = "onnx"
        if precision_name(config) == "int8s":
            from packrat_tasks.quantize_static import RECIPE as what
        onnx = _artifact_key_dir(model_dir, config, what)
    except OSError:
        return True
    return verdict is None or not verdict["ok"] or not build_cache.is_complete(onnx)


def eager_reference(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """fp32 eager: what every mode is compared with."""
    import torch

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return module(*tensors)

    return run


def cached_artifact(runner: Runner, what: str, build: Callable[[Path], None],
                    threads: int | None = None) -> Path | None:
    """build_cache for what this runner's mode builds: the directory holding `build`'s
    files for (archive content, mode, config, `what`, threads, library versions, CPU).

    None when the runner has no archive (an in-process caller) or the cache cannot
    be used: the caller then builds in memory as before. Records "hit" or "built"
    under runner.info["build_cache"][what] (the worker reports it in its status).
    """
    if runner.model_dir is None:
        return None
    from packrat_tasks import build_cache

    extra = {"what": what, "config": build_cache.config_digest(runner.config)}
    try:
        # Keyed as _artifact_key_dir() keys it (runner.mode is mode_name(runner.config)).
        key_dir, hit = build_cache.cached_build(runner.model_dir, runner.mode, build, threads=threads,
                                                extra=extra)
    except OSError as exc:
        log.warning("build cache unusable for %s %s (%s): building without it", runner.mode, what, exc)
        runner.info.setdefault("build_cache", {})[what] = "off"
        return None
    runner.info.setdefault("build_cache", {})[what] = "hit" if hit else "built"
    log.info("build cache %s: %s %s (%s)", "hit" if hit else "built", runner.mode, what, key_dir)
    return key_dir


def build_runner(task: Task, module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...],
                 config: dict[str, Any], kind: str,
                 warmup_inputs: tuple[torch.Tensor, ...] | None = None) -> Runner:
    """make_runner() plus the accuracy guard; sets and returns task.runner.

    `kind` is "classification" or "embedding". The guard's inputs go through
    the task's own preprocess/forward, so padding and masks are those served.
    Raises guard.AccuracyGuardError (with the numbers) when the mode disagrees.
    """
    from packrat_tasks import guard

    mode = mode_name(config)
    batch = None
    th = guard.thresholds(config)
    model_dir = getattr(task, "model_dir", None)
    # The verdict is cached per (archive content, mode, config): a mode this archive
    # passed is not re-guarded by every worker, one it failed is refused at once.
    verdict = guard.cached_verdict(model_dir, mode, kind, config) if mode != "fp32-eager" else None
    if verdict is not None and not verdict["ok"]:
        log.info("%s (cached verdict)", verdict["message"])
        guard.enforce(guard.GuardReport(**verdict))
    t0 = time.perf_counter()
    if mode != "fp32-eager" and verdict is None:
        # Reference first: some modes change the module in place (channels-last).
        batch = task.preprocess(guard.guard_requests(task, th))
        if not batch.valid:
            raise ValueError(f"accuracy guard: the task refused all its guard inputs: {batch.errors}")
        task.runner = eager_reference(materialize(module))
        reference = task.forward(batch).outputs.detach().clone()
    guard_s = time.perf_counter() - t0
    calibration = None
    if precision_name(config) == "int8s":  # calibrated from the archive's own inputs
        from packrat_tasks.quantize_static import calibration_source

        calibration = calibration_source(task, config)
    task.runner = runner = make_runner(module, example_inputs, config, model_dir=model_dir,
                                       calibration=calibration, warmup_inputs=warmup_inputs)
    if batch is not None:
        t0 = time.perf_counter()
        candidate = task.forward(batch).outputs
        compare = guard.compare_classification if kind == "classification" else guard.compare_embedding
        report = compare(mode, reference, candidate, th)
        runner.guard = report.as_dict()
        runner.info.setdefault("build_cache", {})["guard"] = guard.store_verdict(model_dir, mode, kind,
                                                                                 config, report)
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


def build_generation(task: TextGenerationTask, config: dict[str, Any]) -> Runner:
    """Precision for text-generation (greedy decoding runs eager): sets task.model and
    task.autocast, warms up, and guards the first greedy tokens against fp32.

    The task's forward() must run `task.model.generate` inside `task.autocast()`.
    """
    import contextlib

    import torch

    from packrat_tasks import guard

    if precision_name(config) == "int8s":
        from packrat_tasks.quantize_static import generation_refusal

        raise PrecisionError(generation_refusal())
    if runtime_name(config) != "eager":
        raise ValueError("text-generation supports packrat.runtime: eager only "
                         "(the decoding loop is not traced or exported)")
    mode = mode_name(config)
    th = guard.thresholds(config)
    fp32_model = task.model
    task.autocast = contextlib.nullcontext
    tg = time.perf_counter()
    batch = task.preprocess(guard.guard_requests(task, th))
    reference = None
    if mode != "fp32-eager":
        reference = task.forward(batch).outputs.tolist()
    rss0, _ = memory_mb()
    t0 = time.perf_counter()
    task.model, task.autocast = prepare_torch(fp32_model, precision_name(config))
    task.model.eval()
    t1 = time.perf_counter()
    candidate = task.forward(batch).outputs.tolist()  # also the warm-up
    task.forward(batch)
    rss, peak = memory_mb()
    runner = Runner(fn=task.model.generate, mode=mode, threads=torch.get_num_threads(),
                    build_s=round(time.perf_counter() - t0, 3), rss_mb=round(rss, 1),
                    rss_delta_mb=round(rss - rss0, 1), peak_rss_mb=round(peak, 1))
    # The greedy runs are both the warm-up and the guard's candidate: counted as warm-up.
    runner.phases_s = {"guard": round(t0 - tg, 3), "mode_build": round(t1 - t0, 3),
                       "warmup": round(time.perf_counter() - t1, 3)}
    if reference is not None:
        report = guard.compare_generation(mode, reference, candidate, th)
        runner.guard = report.as_dict()
        log.info("%s", report.message)
        guard.enforce(report)
    log.info("packrat mode %s ready: %s", mode, runner.summary())
    return runner


# -- torch runtimes ---------------------------------------------------------

def _channels_last(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> bool:
    """Convolution models (4-D image input) run NHWC: oneDNN's fast layout."""
    import torch

    if any(getattr(t, "dim", lambda: 0)() == 4 for t in example_inputs):
        module.to(memory_format=torch.channels_last)
        return True
    return False


def _nhwc(tensors: tuple[torch.Tensor, ...], on: bool) -> tuple[torch.Tensor, ...]:
    import torch

    if not on:
        return tensors
    return tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in tensors)


@runtime("eager")
def _eager(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
           precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import torch

    module, ctx = prepare_torch(module, precision)
    nhwc = _channels_last(module, example_inputs)
    runner.info["channels_last"] = nhwc

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), ctx():
            return module(*_nhwc(tensors, nhwc)).float()

    return run


@runtime("torchscript")
def _torchscript(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
                 precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import torch

    module, ctx = prepare_torch(module, precision)
    nhwc = _channels_last(module, example_inputs)
    runner.info["channels_last"] = nhwc
    example = _nhwc(example_inputs, nhwc)
    built: list[torch.jit.ScriptModule] = []

    def trace_and_freeze(directory: Path | None = None) -> None:
        # Traced and frozen under the same autocast the calls run in, so the graph
        # records the bf16 casts and freezing folds them into bf16 weights.
        with torch.no_grad(), ctx():
            traced = torch.jit.trace(module, example, check_trace=False)
            built.append(torch.jit.freeze(traced.eval()))
        if directory is not None:  # the frozen graph, before the CPU-specific passes below
            torch.jit.save(built[0], str(directory / "frozen.pt"))

    try:
        key_dir = cached_artifact(runner, "torchscript", trace_and_freeze)
    except RuntimeError as exc:  # a graph torch.jit.save cannot serialise: keep the in-memory one
        if not built:
            raise
        log.warning("frozen TorchScript not cached (%s)", exc)
        key_dir = None
    if built:
        frozen = built[0]
    elif key_dir is not None:
        frozen = torch.jit.load(str(key_dir / "frozen.pt"))
    else:
        trace_and_freeze()
        frozen = built[0]
    if precision != "int8":  # its passes do not know quantised linear packs
        with torch.no_grad(), ctx():
            frozen = torch.jit.optimize_for_inference(frozen)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), ctx():
            return frozen(*_nhwc(tensors, nhwc)).float()

    return run


@runtime("inductor")
def _inductor(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
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
    nhwc = _channels_last(module, example_inputs)
    runner.info["channels_last"] = nhwc
    compiled = torch.compile(module, backend="inductor")
    # One graph for every batch size: the batch dimension is symbolic, the rest
    # (text padded to max_length, 224x224 images) static. Without this each new
    # batch size recompiles (~1 min on 2 cores) in the middle of serving.
    for t in example_inputs:
        torch._dynamo.mark_dynamic(t, 0)

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), ctx():
            return compiled(*_nhwc(tensors, nhwc)).float()

    return run


@runtime("ipex")
def _ipex(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
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


# -- ONNX runtimes ----------------------------------------------------------

def export_onnx(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], directory: str,
                precision: str) -> str:
    """The module as an ONNX file in `directory` (batch and sequence axes dynamic).

    torch 2.13's default exporter is the dynamo one (needs onnxscript);
    dynamo=False selects the TorchScript-based exporter, which needs only `onnx`.
    int8: ONNX Runtime's dynamic quantisation of MatMul/Gemm weights.
    """
    import warnings

    import torch

    names = [f"input_{i}" for i in range(len(example_inputs))]
    axes: dict[str, dict[int, str]] = {}
    for n, t in zip(names, example_inputs):
        axes[n] = {0: "batch"}
        if t.dim() == 2:  # token ids / masks: variable sequence length
            axes[n][1] = "sequence"
    axes["output"] = {0: "batch"}
    path = os.path.join(directory, "model.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example_inputs, path, dynamo=False, input_names=names,
                          output_names=["output"], dynamic_axes=axes, opset_version=17)
    if precision == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = os.path.join(directory, "model.int8.onnx")
        quantize_dynamic(path, quantized, weight_type=QuantType.QInt8)
        return quantized
    return path


@contextlib.contextmanager
def _onnx_file(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], precision: str,
               runner: Runner) -> Iterator[tuple[str, bool]]:
    """(path, cached): the exported ONNX file from the build cache (exported once per
    archive, mode and config), or exported into a temporary directory removed afterwards."""
    names: list[str] = []

    def export(directory: Path) -> None:
        names.append(os.path.basename(export_onnx(materialize(module), example_inputs, str(directory),
                                                  precision)))
        (directory / "onnx-file").write_text(names[0])

    key_dir = cached_artifact(runner, "onnx", export)
    if key_dir is not None:
        yield str(key_dir / (key_dir / "onnx-file").read_text().strip()), True
        return
    with tempfile.TemporaryDirectory(prefix="packrat-onnx-") as tmp:
        yield export_onnx(materialize(module), example_inputs, tmp, precision), False


def _compile_openvino_cached(core: Any, path: str, cache: Path, props: dict[str, Any],
                             runner: Runner) -> Any:
    """compile_model with OpenVINO's own model cache (CACHE_DIR) inside the build-cache
    entry: the first worker compiles and writes the blob (its name hashes the model
    path and the properties, thread count included), later ones import it.

    Compiled from the path (not a read_model() object) so a cache hit never reads
    the ONNX file; under a file lock so workers starting together compile once
    and never read a blob another one is still writing. Once a blob for these
    properties is written, a marker names it, and while it exists later workers
    import it without the lock (the lock made a swap's workers import one after
    the other).
    """
    import hashlib

    from filelock import FileLock

    marker = cache / (".written-" + hashlib.sha256(
        json.dumps(props, sort_keys=True, default=str).encode()).hexdigest()[:16])
    core.set_property({"CACHE_DIR": str(cache)})
    try:
        blobs = json.loads(marker.read_text())
    except (OSError, ValueError):
        blobs = None
    if isinstance(blobs, list) and blobs and all((cache / str(b)).is_file() for b in blobs):
        compiled = core.compile_model(path, "CPU", props)
        runner.info.setdefault("build_cache", {})["openvino_blob"] = "hit"
        return compiled
    with FileLock(str(cache) + ".lock"):
        before = set(os.listdir(cache)) if cache.is_dir() else set()
        compiled = core.compile_model(path, "CPU", props)
        after = set(os.listdir(cache)) if cache.is_dir() else set()
        # The blob just written; on a hit under the lock (a cache from before markers),
        # every blob there: the fast path then needs all of them to exist.
        written = sorted(f for f in (after - before or after) if not f.startswith("."))
        if written:
            tmp = marker.with_name(f"{marker.name}.{os.getpid()}")
            tmp.write_text(json.dumps(written))
            os.replace(tmp, marker)
    os.chmod(cache, 0o700)
    runner.info.setdefault("build_cache", {})["openvino_blob"] = "built" if after - before else "hit"
    return compiled


@contextlib.contextmanager
def _int8s_file(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], runtime_: str,
                runner: Runner) -> Iterator[tuple[str, bool]]:
    """(path, cached) of the int8-static model for `runtime_` (quantize_static.py): calibrated
    and quantised once per archive content and mode in the build cache, else in a temporary
    directory removed once the caller has loaded it. Records the build under runner.info["int8s"]."""
    from packrat_tasks import quantize_static

    with tempfile.TemporaryDirectory(prefix="packrat-int8s-") as scratch:
        path, record = quantize_static.quantized_model(
            runtime_, module, example_inputs, runner.calibration,
            lambda what, build: cached_artifact(runner, what, build), scratch)
        runner.info["int8s"] = record
        yield path, record["cache"] != "off"


def _feeds(names: list[str], tensors: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    return [t.contiguous().numpy() for t in tensors]


@runtime("onnxruntime")
def _onnxruntime(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
                 precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import onnxruntime as ort
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
    files = (_int8s_file(module, example_inputs, "onnxruntime", runner) if precision == "int8s"
             else _onnx_file(module, example_inputs, precision, runner))
    with files as (path, _):
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    runner.info["onnxruntime"] = {"version": ort.__version__, "intra_op_num_threads": threads,
                                  "inter_op_num_threads": 1}

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        out = session.run(None, dict(zip(names, _feeds(names, tensors))))[0]
        return torch.from_numpy(out)

    return run


def openvino_properties(threads: int, precision: str) -> dict[str, Any]:
    """OpenVINO CPU properties for one thin worker of `threads` threads."""
    return {
        "INFERENCE_NUM_THREADS": threads,
        "ENABLE_CPU_PINNING": True,
        "NUM_STREAMS": 1,  # one request at a time per worker; THROUGHPUT would split the cores
        "PERFORMANCE_HINT": "LATENCY",
        # Explicit: OpenVINO's CPU default is bf16 wherever the CPU has it.
        "INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32",
    }


@runtime("openvino")
def _openvino(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
              precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import openvino as ov
    import torch

    if precision == "bf16":
        from packrat_tasks.precision import check_bf16

        check_bf16()
    threads = torch.get_num_threads()
    core = ov.Core()
    props = openvino_properties(threads, precision)
    files = (_int8s_file(module, example_inputs, "openvino", runner) if precision == "int8s"
             else _onnx_file(module, example_inputs, precision, runner))
    with files as (path, cached):
        if cached:
            try:
                compiled = _compile_openvino_cached(core, path, Path(path).parent / "openvino-cache", props,
                                                    runner)
            except OSError as exc:  # e.g. a read-only cache: compile as before, on a core without CACHE_DIR
                log.warning("OpenVINO model cache unusable (%s): compiling without it", exc)
                core = ov.Core()
                compiled = core.compile_model(core.read_model(path), "CPU", props)
        else:
            compiled = core.compile_model(core.read_model(path), "CPU", props)
    request = compiled.create_infer_request()
    runner.info["openvino"] = {
        "version": ov.__version__,
        **{k: str(compiled.get_property(k)) for k in
           ("INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT", "NUM_STREAMS", "ENABLE_CPU_PINNING")},
    }

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        result = request.infer(_feeds([], tensors))
        # infer() returns views of the request's own buffers: copy before the next call.
        return torch.from_numpy(result[0].copy())

    return run


__all__ = [
    "DYNAMIC_SHAPES", "PRECISIONS", "RUNTIMES", "Runner", "build_generation", "build_runner", "eager_reference",
    "make_runner", "memory_mb", "mode_name", "needs_fixed_shapes", "openvino_properties",
    "runtime", "runtime_name",
]

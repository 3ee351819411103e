"""What every runtime builds on: the Runner, the configured mode, lazy modules, the build cache.

    Runner                 a model path ready to serve (call it like the module)
    mode_name(config)      "<packrat.precision>-<packrat.runtime>" (packrat.modes.ExecutionMode)
    LazyModule             a module made on first use (a worker served from the build cache)
    cached_artifact(...)   build_cache for what a runner's mode builds
    load_cached(...)       cached_artifact + load, a hit that fails to load rebuilt once

The runtimes (runtimes/*.py), int8-static (quantize_static.py), the mode
builders (runtime.py) and text-generation (generation.py) import this module;
it imports none of them. Nothing here imports torch at import time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from packrat.modes import ExecutionMode
from packrat_tasks.precision import precision_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


def runtime_name(config: dict[str, Any]) -> str:
    return ExecutionMode.from_config(config).runtime


def mode_name(config: dict[str, Any]) -> str:
    """"<precision>-<runtime>", the same string as the profile fingerprint's mode."""
    return str(ExecutionMode(precision_name(config), runtime_name(config)))


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


def eager_reference(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """fp32 eager: what every mode is compared with."""
    import torch

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return module(*tensors)

    return run


def artifact_key_dir(model_dir: str, config: dict[str, Any], what: str,
                     threads: int | None = None) -> Path:
    """The build-cache directory cached_artifact() uses for `what` (one keying, two callers)."""
    from packrat_tasks import build_cache

    return build_cache.artifact_dir(model_dir, mode_name(config), threads, _artifact_extra(config, what))


def _artifact_extra(config: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """The key beyond (archive, mode, threads) of `what` built for `config`."""
    from packrat_tasks import build_cache

    return {"what": what, "config": build_cache.config_digest(config)}


def cached_artifact(runner: Runner, what: str, build: Callable[[Path], None],
                    threads: int | None = None) -> Path | None:
    """build_cache for what this runner's mode builds: the directory holding `build`'s
    files for (archive content, mode, config, `what`, threads, library versions, CPU).

    None when the runner has no archive (an in-process caller) or the cache cannot
    be used: the caller then builds in memory as before. Records "hit" or "built"
    under runner.info["build_cache"][what] (the worker reports it in its status), and
    the entry's build id under runner.info["artefacts"][what]: the accuracy guard's
    verdict names the builds it judged (runtime.build_runner).
    """
    if runner.model_dir is None:
        return None
    from packrat_tasks import build_cache

    try:
        # Keyed as artifact_key_dir() keys it (runner.mode is mode_name(runner.config)).
        key_dir, hit = build_cache.cached_build(runner.model_dir, runner.mode, build, threads=threads,
                                                extra=_artifact_extra(runner.config, what))
    except OSError as exc:
        log.warning("build cache unusable for %s %s (%s): building without it", runner.mode, what, exc)
        runner.info.setdefault("build_cache", {})[what] = "off"
        return None
    runner.info.setdefault("build_cache", {})[what] = "hit" if hit else "built"
    runner.info.setdefault("artefacts", {})[what] = build_cache.build_id(key_dir)
    log.info("build cache %s: %s %s (%s)", "hit" if hit else "built", runner.mode, what, key_dir)
    return key_dir


def load_cached(runner: Runner, what: str, build: Callable[[Path], None],
                load: Callable[[Path], T]) -> T | None:
    """load(key_dir) of cached_artifact()'s entry (None: no cache, build in memory).

    A hit that fails to load (a damaged file its hashes did not show, a bad pointer)
    is removed and built once more; the new build's id makes the guard run again.
    What a fresh build fails with propagates.
    """
    from packrat_tasks import build_cache

    key_dir = cached_artifact(runner, what, build)
    if key_dir is None:
        return None
    try:
        return load(key_dir)
    except Exception as exc:  # noqa: BLE001 - any load failure of a hit: rebuild once
        if runner.info["build_cache"][what] != "hit":
            raise
        build_cache.discard(key_dir, f"{what} failed to load: {exc}")
    key_dir = cached_artifact(runner, what, build)
    return None if key_dir is None else load(key_dir)

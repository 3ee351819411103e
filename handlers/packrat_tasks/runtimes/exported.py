"""The graph file an ONNX Runtime or OpenVINO runtime loads, through the build cache.

    onnx_file(...)   the exported ONNX graph (fp32, bf16, or int8 dynamically quantised)
    int8s_file(...)  the int8-static model (quantize_static.py)
    load_model_file(...)  model_file + the runtime's load; a cached file that fails to load
                     is removed with its entry and built once more

Both are context managers yielding (path, cached): from the build cache when
the runner has an archive, else from a temporary directory removed on exit.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from packrat_tasks import build_cache, quantize_static
from packrat_tasks.runner import cached_artifact, load_cached, materialize
from packrat_tasks.runtimes.onnx_export import export_onnx

if TYPE_CHECKING:
    import numpy as np
    import torch

    from packrat_tasks.runner import Runner

T = TypeVar("T")


@contextlib.contextmanager
def onnx_file(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], precision: str,
              runner: Runner) -> Iterator[tuple[str, bool]]:
    """(path, cached): the exported ONNX file from the build cache (exported once per
    archive, mode and config), or exported into a temporary directory removed afterwards."""
    names: list[str] = []

    def export(directory: Path) -> None:
        names.append(os.path.basename(export_onnx(materialize(module), example_inputs, str(directory),
                                                  precision)))
        (directory / "onnx-file").write_text(names[0])

    def pointed(key_dir: Path) -> str:  # the pointer names a plain file of the entry, or it is rebuilt
        return str(build_cache.entry_file(key_dir, (key_dir / "onnx-file").read_text()))

    path = load_cached(runner, "onnx", export, pointed)
    if path is not None:
        yield path, True
        return
    with tempfile.TemporaryDirectory(prefix="packrat-onnx-") as tmp:
        yield export_onnx(materialize(module), example_inputs, tmp, precision), False


@contextlib.contextmanager
def int8s_file(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], runtime_: str,
               runner: Runner) -> Iterator[tuple[str, bool]]:
    """(path, cached) of the int8-static model for `runtime_` (quantize_static.py): calibrated
    and quantised once per archive content and mode in the build cache, else in a temporary
    directory removed once the caller has loaded it. Records the build under runner.info["int8s"]."""
    with tempfile.TemporaryDirectory(prefix="packrat-int8s-") as scratch:
        path, record = quantize_static.quantized_model(
            runtime_, module, example_inputs, runner.calibration,
            lambda what, build: cached_artifact(runner, what, build), scratch)
        runner.info["int8s"] = record
        yield path, record["cache"] != "off"


def model_file(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], precision: str,
               runtime_: str, runner: Runner) -> contextlib.AbstractContextManager[tuple[str, bool]]:
    """The file `runtime_` loads for `precision`: int8s_file for int8s, else onnx_file."""
    if precision == "int8s":
        return int8s_file(module, example_inputs, runtime_, runner)
    return onnx_file(module, example_inputs, precision, runner)


def load_model_file(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], precision: str,
                    runtime_: str, runner: Runner, load: Callable[[str, bool], T]) -> T:
    """load(path, cached) of model_file()'s file. A cached file that fails to load (damage
    its hashes did not show: build_cache checks those first) takes its entry with it and
    is built once more (a new build id: the guard judges it again)."""
    handed: list[tuple[str, bool]] = []  # (path, cached) once model_file got that far
    try:
        with model_file(module, example_inputs, precision, runtime_, runner) as (path, cached):
            handed.append((path, cached))
            return load(path, cached)
    except Exception as exc:  # noqa: BLE001 - whatever the runtime raises on a bad file
        if not handed or not handed[0][1]:
            raise
        path = handed[0][0]
        build_cache.discard(Path(path).parent, f"{runtime_} failed to load {Path(path).name}: {exc}")
    with model_file(module, example_inputs, precision, runtime_, runner) as (path, cached):
        return load(path, cached)


def feeds(tensors: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    return [t.contiguous().numpy() for t in tensors]

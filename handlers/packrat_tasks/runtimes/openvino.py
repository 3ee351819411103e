"""packrat.runtime openvino: the exported ONNX graph compiled by OpenVINO's CPU plugin.

INFERENCE_NUM_THREADS = the slot's threads, pinning on, one stream, latency
hint, and the inference precision set explicitly (OpenVINO's CPU default is
bf16 on CPUs that have it). With the graph in the build cache, OpenVINO's own
model cache (compiled blobs) lives beside it: later workers import the blob.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrat_tasks import build_cache
from packrat_tasks.precision import check_bf16
from packrat_tasks.runtimes.exported import feeds, load_model_file

if TYPE_CHECKING:
    import torch

    from packrat_tasks.runner import Runner

log = logging.getLogger(__name__)


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


def compile_cached(core: Any, path: str, cache: Path, props: dict[str, Any], runner: Runner) -> Any:
    """compile_model with OpenVINO's own model cache (CACHE_DIR) inside the build-cache
    entry: the first worker compiles and writes the blob (its name hashes the model
    path and the properties, thread count included), later ones import it.

    Compiled from the path (not a read_model() object) so a cache hit never reads
    the ONNX file; under a file lock so workers starting together compile once
    and never read a blob another one is still writing. Once a blob for these
    properties is written, a marker names it, and while it exists later workers
    import it without the lock (the lock made a swap's workers import one after
    the other). The marker records each blob's sha256 (the blob fsynced first);
    a blob that no longer matches is removed with the marker and compiled again.
    """
    import hashlib

    from filelock import FileLock

    marker = cache / (".written-" + hashlib.sha256(
        json.dumps(props, sort_keys=True, default=str).encode()).hexdigest()[:16])
    core.set_property({"CACHE_DIR": str(cache)})
    if _blobs_intact(cache, marker):
        compiled = core.compile_model(path, "CPU", props)
        runner.info.setdefault("build_cache", {})["openvino_blob"] = "hit"
        return compiled
    with FileLock(str(cache) + ".lock"):
        _blobs_intact(cache, marker)  # a damaged blob named by the marker: removed before the compile
        before = set(os.listdir(cache)) if cache.is_dir() else set()
        compiled = core.compile_model(path, "CPU", props)
        after = set(os.listdir(cache)) if cache.is_dir() else set()
        # The blob just written; on a hit under the lock (a cache from before markers),
        # every blob there: the fast path then needs all of them to exist.
        written = sorted(f for f in (after - before or after) if not f.startswith("."))
        if written:
            tmp = marker.with_name(f"{marker.name}.{os.getpid()}")
            tmp.write_text(json.dumps({name: _sealed_hash(cache / name) for name in written}))
            os.replace(tmp, marker)
    os.chmod(cache, 0o700)
    runner.info.setdefault("build_cache", {})["openvino_blob"] = "built" if after - before else "hit"
    return compiled


def _sealed_hash(blob: Path) -> str:
    """sha256 of a blob OpenVINO wrote, after fsync (a crash cannot leave a marker naming half a blob)."""
    fd = os.open(blob, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return build_cache.file_digest(blob, None)[1].hex()


def _blobs_intact(cache: Path, marker: Path) -> bool:
    """True when the marker names blobs that are all there with their recorded sha256
    (memoised per file stamp); a damaged or missing one: blobs and marker removed, False."""
    try:
        blobs = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(blobs, dict) or not blobs:  # none yet, or a marker from before hashes
        return False
    memo = cache.parent.parent / "digests"  # <root>/<entry>/openvino-cache: the root's memo
    names = [str(name) for name in blobs]
    if not all(_plain(name) for name in names):
        marker.unlink(missing_ok=True)
        return False
    for name in names:
        blob = cache / name
        try:
            ok = (stat.S_ISREG(os.lstat(blob).st_mode)
                  and build_cache.file_digest(blob, memo)[1].hex() == blobs[name])
        except OSError:
            ok = False
        if not ok:
            log.warning("OpenVINO blob %s is damaged or missing: compiling again", blob)
            for other in names:
                (cache / other).unlink(missing_ok=True)
            marker.unlink(missing_ok=True)
            return False
    return True


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


def build(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], config: dict[str, Any],
          precision: str, runner: Runner) -> Callable[..., torch.Tensor]:
    import openvino as ov  # the installed package (absolute import), not this module
    import torch

    if precision == "bf16":
        check_bf16()
    threads = torch.get_num_threads()
    props = openvino_properties(threads, precision)
    def compile_(path: str, cached: bool) -> Any:
        if cached:
            try:
                return compile_cached(ov.Core(), path, Path(path).parent / "openvino-cache", props, runner)
            except OSError as exc:  # e.g. a read-only cache: compile as before, on a core without CACHE_DIR
                log.warning("OpenVINO model cache unusable (%s): compiling without it", exc)
        core = ov.Core()
        return core.compile_model(core.read_model(path), "CPU", props)

    compiled = load_model_file(module, example_inputs, precision, "openvino", runner, compile_)
    request = compiled.create_infer_request()
    runner.info["openvino"] = {
        "version": ov.__version__,
        **{k: str(compiled.get_property(k)) for k in
           ("INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT", "NUM_STREAMS", "ENABLE_CPU_PINNING")},
    }

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        result = request.infer(feeds(tensors))
        # infer() returns views of the request's own buffers: copy before the next call.
        return torch.from_numpy(result[0].copy())

    return run

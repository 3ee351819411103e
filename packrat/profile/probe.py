"""What this machine can run for one archive, asked of the archive's own code in a fresh process.

    python -m packrat.profile.probe ARCHIVE_DIR      -> one JSON object on stdout

    {"task": "text-classification",
     "mode": "fp32-eager",                      # the archive's own mode
     "runtimes": ["eager", "torchscript", ...], # what its packrat_tasks.runtime registers
     "bf16": null | "why not",                  # packrat_tasks.precision.check_bf16()
     "int8": null | "why not",                  # int8-static's speed: VNNI/AMX/AVX2 int8 flags
     "unavailable": {"openvino": "ModuleNotFoundError: ...",
                     "int8s-openvino": "nncf is not installed", ...},
     "libraries": {"openvino": "2026.4.1", "nncf": null, ...}}  # library_versions(PROBED_LIBRARIES) then

bf16 is judged by the handler's own check (native avx512_bf16/AMX flags and
oneDNN's bf16 support), so the tuner offers bf16 exactly where a worker would
accept it; a foreign runtime counts as available only if it imports here.
The probe runs in its own interpreter because importing torch, ONNX Runtime
or OpenVINO into the controller would start their thread pools there. That costs
seconds (~6.5 s of imports on 2 cores), so a tune reuses the last tune's answer
while the archive, the machine and these libraries' versions are the same
(packrat.tune.run.capabilities_for).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packrat.errors import ProfileError
from packrat.modes import ExecutionMode, library_versions

# Modules each runtime needs beyond torch (the ONNX runtimes export with `onnx`).
RUNTIME_IMPORTS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnx", "onnxruntime"),
    "openvino": ("onnx", "openvino"),
    "ipex": ("intel_extension_for_pytorch",),
}
# What int8-static (precision int8s) needs beyond its runtime: the quantisation tool.
INT8S_IMPORTS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime.quantization",),
    "openvino": ("nncf",),
}

# The installed distributions a probe's answer depends on beyond the archive and the
# machine's fingerprint: one installed, removed or upgraded since makes a reused answer stale.
PROBED_LIBRARIES = ("torch", "onnx", "onnxruntime", "openvino", "nncf", "intel_extension_for_pytorch")


@dataclass(frozen=True)
class Capabilities:
    task: str | None
    mode: str  # the archive's own mode
    runtimes: tuple[str, ...]  # registered by the archive's runtime module and importable here
    bf16: str | None  # None: native bf16 works; else why not
    # runtime (or "int8s-<runtime>": its quantisation tool) -> why not
    unavailable: dict[str, str] = field(default_factory=dict)
    int8: str | None = None  # None: the CPU has SIMD int8 multiply-add (VNNI, AMX or AVX2); else why not
    libraries: dict[str, str | None] = field(default_factory=dict)  # library_versions(PROBED_LIBRARIES) when probed

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "mode": self.mode, "runtimes": list(self.runtimes),
                "bf16": self.bf16, "int8": self.int8, "unavailable": dict(self.unavailable),
                "libraries": dict(self.libraries)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Capabilities:
        """The probe's JSON (or to_dict's); KeyError without "mode"."""
        return cls(task=d.get("task"), mode=d["mode"], runtimes=tuple(d.get("runtimes") or ()),
                   bf16=d.get("bf16"), unavailable=dict(d.get("unavailable") or {}),
                   int8=d.get("int8", "the probe reported nothing about int8 (an older probe)"),
                   libraries=dict(d.get("libraries") or {}))


def probe_archive(archive_dir: str | Path, timeout_s: float = 180.0) -> Capabilities:
    """Run the probe on `archive_dir` in a child interpreter; ProfileError if it fails."""
    try:
        r = subprocess.run([sys.executable, "-m", "packrat.profile.probe", str(archive_dir)],
                           capture_output=True, text=True, timeout=timeout_s,
                           env=_child_env())
    except subprocess.TimeoutExpired as exc:
        raise ProfileError(f"capability probe of {archive_dir} timed out after {timeout_s:.0f} s") from exc
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        raise ProfileError(f"capability probe of {archive_dir} failed (exit {r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()[-800:]}")
    return Capabilities.from_dict(json.loads(lines[-1]))


def _child_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # write no __pycache__ into the archive directory
    env.setdefault("OMP_NUM_THREADS", "1")  # the probe computes nothing
    env.setdefault("NNCF_CI", "1")  # importing nncf must not start its usage telemetry
    return env


def _probe(archive_dir: str) -> dict[str, Any]:
    import yaml

    sys.path.insert(0, archive_dir)
    config = yaml.safe_load((Path(archive_dir) / "model_config.yaml").read_text()) or {}
    section = config.get("packrat") or {}
    from packrat_tasks import precision, runtime  # the archive's own copies

    out: dict[str, Any] = {
        "task": section.get("task"),
        "mode": str(ExecutionMode.from_config(config)),
        "bf16": None,
        "unavailable": {},
    }
    try:
        precision.check_bf16()
    except precision.PrecisionError as exc:
        out["bf16"] = str(exc)
    except Exception as exc:  # e.g. torch without mkldnn ops
        out["bf16"] = f"{type(exc).__name__}: {exc}"
    check_int8 = getattr(precision, "int8_static_problem", None)
    out["int8"] = (check_int8(precision.cpu_flags()) if check_int8 is not None
                   else "this archive's packrat_tasks has no int8s precision")
    available = []
    for name in sorted(runtime.RUNTIMES):
        problem = _import_problem(RUNTIME_IMPORTS.get(name, ()))
        if problem:
            out["unavailable"][name] = problem
        else:
            available.append(name)
            if name in INT8S_IMPORTS:
                tool = _import_problem(INT8S_IMPORTS[name])
                if tool:
                    out["unavailable"][f"int8s-{name}"] = tool
    out["runtimes"] = available
    out["libraries"] = library_versions(PROBED_LIBRARIES)
    return out


def _import_problem(modules: tuple[str, ...]) -> str | None:
    import importlib
    import importlib.util
    import os

    os.environ.setdefault("NNCF_CI", "1")  # importing nncf must not start its usage telemetry

    for module in modules:
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
            importlib.import_module(module)
        except Exception as exc:  # an installed wheel that does not load here
            return f"{module} does not import: {type(exc).__name__}: {exc}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m packrat.profile.probe ARCHIVE_DIR", file=sys.stderr)
        return 2
    print(json.dumps(_probe(argv[1])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Write model archives as TorchServe "no-archive" directories in the model store.

Layout of <model-store>/<name>/ (what torch-model-archiver --archive-format
no-archive produces, plus our config):

    MAR-INF/MANIFEST.json   model name, version, handler = packrat_handler.py
    model_config.yaml       TorchServe serving keys + the `packrat:` section
    packrat_handler.py      entry point (from handlers/)
    packrat_tasks/**.py     task code (from handlers/; runtimes/ is a subpackage)
    model/                  HF files: config.json, model.safetensors, tokenizer

TorchServe 0.12 registers such a directory by its name
(`POST /models?url=<name>`). Content is deterministic (fixed seed, fixed
manifest, sorted YAML), so packrat.profile.identity.content_hash identifies it.
The directory is written beside its final place and renamed in one step, so a
server never sees half an archive.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from packrat.errors import ArchiveError
from packrat.modes import (
    PRECISIONS,
    RUNTIMES,
    TEXT_GENERATION,
    ExecutionMode,
    int8s_runtime_refusal,
    int8s_task_refusal,
    pairing_refusal,
    task_refusal,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HANDLER_DIR = REPO_ROOT / "handlers"
HANDLER_FILE = "packrat_handler.py"
TASKS_PACKAGE = "packrat_tasks"
MODEL_SUBDIR = "model"
TASKS = ("text-classification", "feature-extraction", TEXT_GENERATION, "image-classification", "noop")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# HF files worth carrying from a local model directory.
_HF_SUFFIXES = (".json", ".txt", ".safetensors", ".model")
_HF_SKIP = {"modules.json", "config_sentence_transformers.json", "data_config.json"}


@dataclass(frozen=True)
class ArchiveOptions:
    task: str | None = None  # default: the architecture's / inferred from config.json
    runtime: str = "eager"
    precision: str = "fp32"  # packrat.precision (docs/modes.md)
    batch_size: int = 1
    max_batch_delay_ms: int = 5
    max_new_tokens_cap: int | None = None
    max_length: int | None = None
    version: str = "1.0"
    seed: int = 0
    workers: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # more packrat.* keys (limits, top_k)


def _check(name: str, options: ArchiveOptions, task: str) -> None:
    if not _NAME_RE.match(name):
        raise ArchiveError(f"archive name {name!r} must match {_NAME_RE.pattern}")
    if options.task is not None and options.task not in TASKS:
        raise ArchiveError(f"--task must be one of {', '.join(TASKS)}, got {options.task!r}")
    if options.runtime not in RUNTIMES:
        raise ArchiveError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {options.runtime!r}")
    if options.precision not in PRECISIONS:
        raise ArchiveError(f"--precision must be one of {', '.join(PRECISIONS)}, got {options.precision!r}")
    if options.precision == "int8s" and (int8s_task_refusal(task) or int8s_runtime_refusal(options.runtime)):
        raise ArchiveError("int8s (int8-static) runs on onnxruntime or openvino, and not for text-generation "
                           "(docs/modes.md)")
    if task_refusal(task, options.runtime):
        raise ArchiveError("text-generation runs eager only (the generation loop is not traced)")
    if options.precision == "bf16w" and (why := pairing_refusal(ExecutionMode(options.precision, options.runtime))):
        raise ArchiveError(why)
    for label, value in (("--batch-size", options.batch_size), ("--workers", options.workers)):
        if value < 1:
            raise ArchiveError(f"{label} must be >= 1, got {value}")
    if options.max_batch_delay_ms < 0:
        raise ArchiveError("--max-batch-delay must be >= 0")


def _model_config(task: str, packrat: dict[str, Any], options: ArchiveOptions) -> dict[str, Any]:
    section = {"task": task, "runtime": options.runtime, "precision": options.precision,
               "model_dir": MODEL_SUBDIR}
    section.update({k: v for k, v in packrat.items() if v is not None})
    if options.max_length is not None:
        section["max_length"] = options.max_length
    if options.max_new_tokens_cap is not None:
        section["max_new_tokens_cap"] = options.max_new_tokens_cap
        section["default_max_new_tokens"] = min(
            int(section.get("default_max_new_tokens", options.max_new_tokens_cap)),
            options.max_new_tokens_cap,
        )
    section.update(options.extra)
    return {
        # TorchServe reads these at registration (register-call parameters win).
        "minWorkers": options.workers,
        "maxWorkers": options.workers,
        "batchSize": options.batch_size,
        "maxBatchDelay": options.max_batch_delay_ms,
        "responseTimeout": 120,
        "startupTimeout": 600,  # frozen TorchScript of a full-size model takes a while on 2 cores
        "packrat": section,
    }


def _manifest(name: str, version: str) -> dict[str, Any]:
    # No createdOn: a timestamp would make identical archives differ
    # (TorchServe only logs a warning when it is missing).
    return {
        "runtime": "python",
        "model": {
            "modelName": name,
            "modelVersion": version,
            "handler": HANDLER_FILE,
            "configFile": "model_config.yaml",
        },
        "archiverVersion": "0.12.0",
    }


def _task_sources(root: Path) -> list[Path]:
    """The task package's sources under `root`, subpackages (runtimes/) included, as
    paths relative to root/TASKS_PACKAGE in sorted order."""
    package = root / TASKS_PACKAGE
    return sorted(p.relative_to(package) for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def _copy_handler(dest: Path) -> None:
    if not (HANDLER_DIR / HANDLER_FILE).exists():
        raise ArchiveError(f"handler sources not found in {HANDLER_DIR}")
    shutil.copy2(HANDLER_DIR / HANDLER_FILE, dest / HANDLER_FILE)
    for rel in _task_sources(HANDLER_DIR):
        (dest / TASKS_PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(HANDLER_DIR / TASKS_PACKAGE / rel, dest / TASKS_PACKAGE / rel)


def handler_is_current(archive: Path) -> bool:
    """True when `archive` holds exactly this checkout's handler sources. A benchmark that
    reuses a built archive measures the handler it was built with: rebuild it otherwise."""
    archive = Path(archive)
    ours, theirs = _task_sources(HANDLER_DIR), _task_sources(archive)
    if ours != theirs or not (archive / HANDLER_FILE).is_file():
        return False
    pairs = [(HANDLER_DIR / HANDLER_FILE, archive / HANDLER_FILE)]
    pairs += [(HANDLER_DIR / TASKS_PACKAGE / r, archive / TASKS_PACKAGE / r) for r in ours]
    return all(a.read_bytes() == b.read_bytes() for a, b in pairs)


def _write(
    model_store: Path, name: str, task: str, packrat: dict[str, Any], options: ArchiveOptions,
    fill_model_dir, force: bool, reuse_current: bool = False,
) -> Path:
    model_store = Path(model_store)
    model_store.mkdir(parents=True, exist_ok=True)
    final = model_store / name
    if final.exists() and reuse_current and handler_is_current(final):
        return final
    if final.exists() and not (force or reuse_current):
        raise ArchiveError(f"{final} already exists (use --force to rebuild)")
    tmp = model_store / f".{name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "MAR-INF").mkdir(parents=True)
        (tmp / "MAR-INF" / "MANIFEST.json").write_text(
            json.dumps(_manifest(name, options.version), indent=2, sort_keys=True) + "\n"
        )
        (tmp / "model_config.yaml").write_text(
            yaml.safe_dump(_model_config(task, packrat, options), sort_keys=True)
        )
        _copy_handler(tmp)
        if fill_model_dir is not None:
            (tmp / MODEL_SUBDIR).mkdir()
            fill_model_dir(tmp / MODEL_SUBDIR)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def build_named(
    arch_name: str, model_store: Path, name: str | None = None,
    options: ArchiveOptions = ArchiveOptions(), force: bool = False, reuse_current: bool = False,
) -> Path:
    """An archive of a named architecture with seeded random weights. `reuse_current`: keep
    an existing archive that holds this checkout's handler, rebuild one that does not."""
    from packrat.archive.architectures import ARCHITECTURES, build_model

    if arch_name == "noop":
        return build_noop(model_store, name or "noop", options, force, reuse_current)
    if arch_name == "minilm":  # real weights, shipped by a package: no architecture to seed
        from packrat.archive.local_tokenizers import minilm_dir

        return build_from_dir(minilm_dir(), model_store, name or "minilm", options, force, reuse_current)
    if arch_name not in ARCHITECTURES:
        raise ArchiveError(
            f"unknown architecture {arch_name!r}; known: noop, minilm, {', '.join(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[arch_name]
    name = name or arch_name
    task = options.task or arch.default_task
    _check(name, options, task)
    if task not in arch.tasks:
        raise ArchiveError(f"{arch_name} supports tasks {', '.join(arch.tasks)}, not {task}")

    def fill(model_dir: Path) -> None:
        model, tokenizer = build_model(arch, task, options.seed)
        model.save_pretrained(model_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(model_dir)

    return _write(model_store, name, task, dict(arch.packrat, seed=options.seed), options, fill, force,
                  reuse_current)


def build_noop(model_store: Path, name: str = "noop", options: ArchiveOptions = ArchiveOptions(),
               force: bool = False, reuse_current: bool = False) -> Path:
    """The echo task: no model, measures TorchServe's own round trip."""
    _check(name, options, "noop")
    return _write(model_store, name, "noop", {}, options, None, force, reuse_current)


def infer_task(config: dict[str, Any]) -> str:
    arch = " ".join(config.get("architectures") or [])
    if "ForSequenceClassification" in arch:
        return "text-classification"
    if "LMHead" in arch or "CausalLM" in arch:
        return "text-generation"
    if "ForImageClassification" in arch:
        return "image-classification"
    if arch.endswith("Model"):
        return "feature-extraction"
    raise ArchiveError(f"cannot tell the task from architectures={arch!r}; pass --task")


def build_from_dir(
    src: Path, model_store: Path, name: str, options: ArchiveOptions = ArchiveOptions(),
    force: bool = False, reuse_current: bool = False,
) -> Path:
    """An archive of a local Hugging Face model directory with real weights (`reuse_current`:
    see build_named)."""
    src = Path(src)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ArchiveError(f"{src} is not a Hugging Face model directory (no config.json)")
    if not any(src.glob("*.safetensors")):
        raise ArchiveError(f"{src} has no *.safetensors weights")
    config = json.loads(config_path.read_text())
    task = options.task or infer_task(config)
    _check(name, options, task)
    packrat: dict[str, Any] = {}
    sbert = src / "sentence_bert_config.json"
    if sbert.is_file():  # sentence-transformers' own sequence limit (MiniLM: 256)
        packrat["max_length"] = int(json.loads(sbert.read_text()).get("max_seq_length", 128))
    elif task != "image-classification":
        packrat["max_length"] = min(int(config.get("max_position_embeddings", 512)), 512)
    if task == "text-generation":
        packrat.update(max_new_tokens_cap=64, default_max_new_tokens=16)
    if task == "image-classification":
        packrat["top_k"] = 5

    def fill(model_dir: Path) -> None:
        for f in sorted(src.iterdir()):
            if f.is_file() and f.suffix in _HF_SUFFIXES and f.name not in _HF_SKIP:
                shutil.copyfile(f, model_dir / f.name)

    return _write(model_store, name, task, packrat, options, fill, force, reuse_current)

"""Which model a profile belongs to: an archive's content hash.

The hash must change when anything that affects one forward pass changes
(weights, code, tokenizer, precision, graph mode) and must NOT change when
only the serving shape changes, because Packrat itself rewrites the serving
shape of every version it deploys (worker count, batch cap, slots). Rule:

    model_id = "sha256:" + sha256 over every file of the archive, in sorted
               relative-path order, of  path + NUL + len + NUL + content

with these exceptions:
  * skipped entirely: `__pycache__/` directories and `*.pyc` (importing the
    handler from the archive directory writes them), `.lock` files;
  * MAR-INF/MANIFEST.json: hashed as canonical JSON without `createdOn`
    (a timestamp) and `modelVersion` (active and passive versions of one model
    differ only there);
  * model_config.yaml: hashed as canonical JSON without the serving-shape keys
    SERVING_SHAPE_KEYS (top level) and `packrat.slots` / `packrat.plan_id`.
A `.mar` file is hashed over its unpacked contents, so a .mar and the
directory it was unpacked into have the same id.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from packrat.errors import ConfigError
from packrat.modes import ExecutionMode

HANDLER_MODULE = "packrat_handler"
CONFIG_NAME = "model_config.yaml"
MANIFEST_PATH = "MAR-INF/MANIFEST.json"

# TorchServe frontend keys that only change how many workers run and how
# requests are grouped, not what one call to the handler computes.
SERVING_SHAPE_KEYS = frozenset(
    {
        "minWorkers",
        "maxWorkers",
        "batchSize",
        "maxBatchDelay",
        "responseTimeout",
        "startupTimeout",
        "workers",
        "maxRetryTimeoutInSec",
        "clientTimeoutInMills",
    }
)
PACKRAT_SHAPE_KEYS = frozenset({"slots", "plan_id"})
MANIFEST_VOLATILE_KEYS = frozenset({"createdOn", "modelVersion"})


@dataclass(frozen=True)
class ArchiveRef:
    """An archive directory ready to import its handler from."""

    directory: Path
    source: Path  # what the user named (a directory or a .mar)
    config: dict[str, Any]
    model_id: str
    model_name: str
    # Keeps a .mar's unpacked temporary directory alive as long as the ref.
    _tmp: Any = None


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def serving_free_config(config: dict[str, Any]) -> dict[str, Any]:
    """model_config.yaml without the keys that only change the serving shape."""
    out = {k: v for k, v in config.items() if k not in SERVING_SHAPE_KEYS}
    packrat_cfg = out.get("packrat")
    if isinstance(packrat_cfg, dict):
        rest = {k: v for k, v in packrat_cfg.items() if k not in PACKRAT_SHAPE_KEYS}
        if rest:
            out["packrat"] = rest
        else:
            out.pop("packrat")
    return out


def _skipped(rel: Path) -> bool:
    return "__pycache__" in rel.parts or rel.suffix in {".pyc", ".lock"}


def _file_digest_bytes(rel: str, path: Path) -> bytes:
    if rel == CONFIG_NAME:
        return _canonical(serving_free_config(read_config_file(path)))
    if rel == MANIFEST_PATH:
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: unreadable MANIFEST.json ({exc})") from exc
        manifest = {k: v for k, v in manifest.items() if k not in MANIFEST_VOLATILE_KEYS}
        return _canonical(manifest)
    return path.read_bytes()


def content_hash(directory: Path) -> str:
    """The archive's model id (see the module docstring for what is excluded)."""
    h = hashlib.sha256()
    files = sorted(
        (p for p in directory.rglob("*") if p.is_file() and not _skipped(p.relative_to(directory))),
        key=lambda p: p.relative_to(directory).as_posix(),
    )
    for path in files:
        rel = path.relative_to(directory).as_posix()
        data = _file_digest_bytes(rel, path)
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return "sha256:" + h.hexdigest()


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc.__class__.__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _model_name(directory: Path, source: Path) -> str:
    manifest = directory / MANIFEST_PATH
    if manifest.is_file():
        try:
            name = json.loads(manifest.read_text()).get("model", {}).get("modelName")
            if name:
                return str(name)
        except (OSError, ValueError):
            pass
    return source.stem if source.suffix == ".mar" else source.name


def archive_in_mode(archive: ArchiveRef, mode: str) -> ArchiveRef:
    """The same archive run in another execution mode: its config with
    packrat.precision/runtime replaced. The model id stays the base archive's
    hash; the mode goes into the profile's fingerprint (packrat.profile.fingerprint)."""
    from dataclasses import replace

    return replace(archive, config=ExecutionMode.parse(mode).in_config(archive.config))


def open_archive(path: str | Path) -> ArchiveRef:
    """Resolve an archive directory or a .mar file; ConfigError if it is neither."""
    source = Path(path)
    tmp = None
    if source.is_file() and source.suffix == ".mar":
        tmp = tempfile.TemporaryDirectory(prefix="packrat-profile-")
        try:
            with zipfile.ZipFile(source) as zf:
                zf.extractall(tmp.name)
        except (OSError, zipfile.BadZipFile) as exc:
            tmp.cleanup()
            raise ConfigError(f"{source}: not a readable .mar archive ({exc})") from exc
        directory = Path(tmp.name)
    elif source.is_dir():
        directory = source.resolve()
    elif not source.exists():
        raise ConfigError(f"{source}: no such file or directory")
    else:
        raise ConfigError(f"{source}: expected an archive directory or a .mar file")

    if not (directory / f"{HANDLER_MODULE}.py").is_file() and not (directory / HANDLER_MODULE).is_dir():
        raise ConfigError(
            f"{source}: not a Packrat archive (no {HANDLER_MODULE}.py); build one with `packrat archive`"
        )
    config_path = directory / CONFIG_NAME
    config = read_config_file(config_path) if config_path.is_file() else {}
    return ArchiveRef(
        directory=directory,
        source=source,
        config=config,
        model_id=content_hash(directory),
        model_name=_model_name(directory, source),
        _tmp=tmp,
    )

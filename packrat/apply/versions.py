"""Version directories: one TorchServe model version per plan.

A version directory lives in the model store beside the base model directory
(a torch-model-archiver "no-archive" directory) and holds
- a relative symlink to every file of the base directory (weights, handler,
  tokenizer, ...): never a copy, so a version costs a few kB;
- its own `model_config.yaml`: the base config plus batchSize (the plan's
  batch cap), minWorkers = maxWorkers = number of instances, and a `packrat`
  section with the plan id, one slot per instance (cores, threads) and the
  plan itself for the record; a plan with a `mode` also sets
  packrat.precision / packrat.runtime (docs/tuning.md);
- its own `MAR-INF/MANIFEST.json` with a new `modelVersion`: TorchServe takes
  the version from the manifest, not from the register call.

TorchServe registers it by its directory name (`POST /models?url=<dir name>`),
so a worker that TorchServe restarts reads the same plan again.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from packrat.errors import ConfigError, TorchServeError
from packrat.profile.fingerprint import mode_from_config, split_mode
from packrat.types import Plan

if TYPE_CHECKING:
    from packrat.apply.client import ManagementClient

MANIFEST = Path("MAR-INF") / "MANIFEST.json"
CONFIG = "model_config.yaml"
# Version strings Packrat creates: p<sequence>, e.g. "p12". Directory: <model>.p12
_VERSION_RE = re.compile(r"^p(\d+)$")
# Collect batches for at least this long (ms) once the first request is in.
DEFAULT_MAX_BATCH_DELAY_MS = 5
# TorchServe closes a batch maxBatchDelay after its first request, full or not
# (Model.pollBatch in 0.12). Clients that were answered together come back
# spread over more than 5 ms when there are many of them: the batch closes part
# full and the rest wait a whole batch (measured, GPT-2 cap 32 with 5 ms: mean
# batch 22-24, p50 2.7-3.0 s against a predicted 2.0 s; docs/benchmarks.md).
# Waiting a tenth of the batch's own predicted latency to fill it costs at most that tenth.
BATCH_FILL_FRACTION = 0.1
MAX_BATCH_DELAY_CAP_MS = 100
# A `.<model>.pN.tmp-*` directory this old was left by a create that was killed mid-write.
STALE_TMP_S = 3600.0


def batch_delay_ms(plan: Plan, given: int | None = None) -> int:
    """maxBatchDelay for a plan: `given` if set, else a tenth of its slowest instance's
    predicted batch latency, within [DEFAULT_MAX_BATCH_DELAY_MS, MAX_BATCH_DELAY_CAP_MS];
    the floor for a cap of 1 or a plan without predictions."""
    if given is not None:
        return given
    cap = max((i.batch for i in plan.instances), default=1)
    latency = max((i.latency_ms for i in plan.instances), default=0.0)
    if cap <= 1 or latency <= 0:
        return DEFAULT_MAX_BATCH_DELAY_MS
    return int(min(MAX_BATCH_DELAY_CAP_MS, max(DEFAULT_MAX_BATCH_DELAY_MS, round(BATCH_FILL_FRACTION * latency))))


@dataclass(frozen=True)
class Slot:
    cores: tuple[int, ...]
    threads: int
    batch: int


@dataclass(frozen=True)
class VersionDir:
    model: str
    version: str
    path: Path
    plan_id: str
    base: str  # directory name of the base model in the model store
    plan: Plan
    slots: tuple[Slot, ...]
    batch_size: int
    max_batch_delay_ms: int

    @property
    def url(self) -> str:
        """What to pass as `url` to TorchServe's register call: the directory name."""
        return self.path.name


def validate_plan(plan: Plan, usable_cores: int) -> None:
    """Reject what no version can realise; raised before anything is created."""
    if not plan.instances:
        raise ConfigError("a plan needs at least one instance")
    if plan.mode is not None:
        try:
            split_mode(plan.mode)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    for i in plan.instances:
        if i.threads < 1:
            raise ConfigError(f"instance {i}: threads must be >= 1")
        if i.batch < 1:
            raise ConfigError(f"instance {i}: batch must be >= 1")
    if plan.threads_used > usable_cores:
        raise ConfigError(
            f"plan uses {plan.threads_used} threads but only {usable_cores} cores are usable"
        )
    if plan.cores > usable_cores:
        raise ConfigError(f"plan is for {plan.cores} cores but only {usable_cores} are usable")


def assign_cores(plan: Plan, cores: list[int]) -> tuple[Slot, ...]:
    """Give each instance its own contiguous run of `cores`, widest instance first.

    Deterministic: the same plan always gets the same layout, so a new version
    of an unchanged shape lands on exactly the cores of the old one.
    """
    if plan.threads_used > len(cores):
        raise ConfigError(f"plan needs {plan.threads_used} cores, {len(cores)} given")
    slots = []
    offset = 0
    for inst in sorted(plan.instances, key=lambda i: (-i.threads, -i.batch)):
        slots.append(Slot(tuple(cores[offset : offset + inst.threads]), inst.threads, inst.batch))
        offset += inst.threads
    return tuple(slots)


def read_manifest(model_dir: Path) -> dict[str, Any]:
    path = model_dir / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a TorchServe model directory ({exc})") from exc


def read_config(model_dir: Path) -> dict[str, Any]:
    manifest = read_manifest(model_dir)
    name = (manifest.get("model") or {}).get("configFile") or CONFIG
    path = model_dir / name
    if not path.exists():
        return {}
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:  # a broken file names itself (issue 31), never a crash
        raise ConfigError(f"{path}: broken model config ({exc})") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: broken model config (a {type(config).__name__}, not a mapping)")
    return config


def next_version(model_store: Path, model: str) -> str:
    """p<n+1> where n is the highest sequence of this model's version dirs in the store."""
    highest = 0
    for p in model_store.glob(f"{model}.p*"):
        m = _VERSION_RE.match(p.name[len(model) + 1 :])
        if m:
            highest = max(highest, int(m.group(1)))
    return f"p{highest + 1}"


def create_version(
    model_store: str | Path,
    base: str,
    model: str,
    plan: Plan,
    cores: list[int],
    *,
    version: str | None = None,
    max_batch_delay_ms: int | None = None,
) -> VersionDir:
    """Write `<model_store>/<model>.<version>/` for `plan`; see the module docstring.

    `max_batch_delay_ms` None: `batch_delay_ms(plan)`.
    """
    store = Path(model_store)
    base_dir = store / base
    validate_plan(plan, len(cores))
    if not plan.realizable:
        raise ConfigError(
            "plan instances have different batch caps; one TorchServe version has one batch_size "
            f"({sorted({i.batch for i in plan.instances})})"
        )
    manifest = read_manifest(base_dir)
    config_name = (manifest.get("model") or {}).get("configFile") or CONFIG
    sweep_stale_tmp(store, model)
    version = version or next_version(store, model)
    path = store / f"{model}.{version}"
    if path.exists():
        raise ConfigError(f"{path} already exists")
    vdir = VersionDir(
        model=model,
        version=version,
        path=path,
        plan_id=f"{model}-{version}-{uuid.uuid4().hex[:8]}",
        base=base,
        plan=plan,
        slots=assign_cores(plan, cores),
        batch_size=plan.instances[0].batch,
        max_batch_delay_ms=batch_delay_ms(plan, max_batch_delay_ms),
    )
    tmp = store / f".{path.name}.tmp-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    try:
        for entry in base_dir.iterdir():
            if entry.name in ("MAR-INF", config_name):
                continue
            # Relative link: the store can be moved as a whole.
            os.symlink(Path("..") / base / entry.name, tmp / entry.name)
        config = _version_config(read_config(base_dir), vdir)
        (tmp / config_name).write_text(yaml.safe_dump(config, sort_keys=False))
        (tmp / "MAR-INF").mkdir()
        (tmp / MANIFEST).write_text(json.dumps(_version_manifest(manifest, vdir, config_name), indent=2))
        # Appears complete or not at all (a controller restarted mid-write finds no half dir).
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return vdir


def sweep_stale_tmp(store: Path, model: str, max_age_s: float = STALE_TMP_S) -> list[str]:
    """Remove `.<model>.pN.tmp-*` directories older than `max_age_s`: what creates killed
    mid-write left (the rename that completes a version never happened). A younger
    one may be a create still running. Returns the names removed."""
    now, removed = time.time(), []
    for path in store.glob(f".{glob.escape(model)}.p*.tmp-*"):
        try:
            st = path.lstat()
        except OSError:
            continue
        if now - st.st_mtime > max_age_s and not path.is_symlink() and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _version_config(base_config: dict[str, Any], vdir: VersionDir) -> dict[str, Any]:
    """The base's model_config.yaml with the version's shape and its `packrat` section."""
    config = dict(base_config)
    # The base's own packrat keys (task, precision, ...) stay; the shape keys are ours.
    packrat_cfg = dict(base_config.get("packrat") or {})
    if vdir.plan.mode is not None:
        # The plan's mode overrides the base's: one base archive serves every mode,
        # so a swap changes the mode and the shape together.
        packrat_cfg["precision"], packrat_cfg["runtime"] = split_mode(vdir.plan.mode)
    packrat_cfg.update(
        {
            "plan_id": vdir.plan_id,
            "base": vdir.base,
            "slots": [{"cores": list(s.cores), "threads": s.threads} for s in vdir.slots],
            "plan": vdir.plan.to_dict(),
        }
    )
    config.update(
        {
            "batchSize": vdir.batch_size,
            "maxBatchDelay": vdir.max_batch_delay_ms,
            "minWorkers": len(vdir.slots),
            "maxWorkers": len(vdir.slots),
            "packrat": packrat_cfg,
        }
    )
    return config


def _version_manifest(manifest: dict[str, Any], vdir: VersionDir, config_name: str) -> dict[str, Any]:
    """The base's MANIFEST.json naming the version: TorchServe takes the version from it."""
    new_manifest = json.loads(json.dumps(manifest))
    new_manifest.setdefault("model", {})
    new_manifest["model"]["modelName"] = vdir.model
    new_manifest["model"]["modelVersion"] = vdir.version
    new_manifest["model"]["configFile"] = config_name
    return new_manifest


def load_version(path: str | Path) -> VersionDir | None:
    """Read back a version directory Packrat wrote; None for a plain (non-Packrat) model dir."""
    path = Path(path)
    manifest = read_manifest(path)
    config = read_config(path)
    pr = config.get("packrat")
    if not isinstance(pr, dict) or "plan" not in pr:
        return None
    try:
        plan = Plan.from_dict(pr["plan"])
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return VersionDir(
        model=manifest["model"]["modelName"],
        version=manifest["model"]["modelVersion"],
        path=path,
        plan_id=str(pr["plan_id"]),
        base=str(pr["base"]),
        plan=plan,
        slots=tuple(
            Slot(tuple(int(c) for c in s["cores"]), int(s["threads"]), int(config.get("batchSize", 1)))
            for s in pr["slots"]
        ),
        batch_size=int(config.get("batchSize", 1)),
        max_batch_delay_ms=int(config.get("maxBatchDelay", DEFAULT_MAX_BATCH_DELAY_MS)),
    )


def served_mode(model_dir: str | Path) -> str | None:
    """The execution mode a registered directory (base or version) runs, from its
    model_config.yaml; None for a directory that is not a Packrat archive (no packrat.task)."""
    try:
        config = read_config(Path(model_dir))
    except ConfigError:
        return None
    if not isinstance(config.get("packrat"), dict) or "task" not in config["packrat"]:
        return None
    return mode_from_config(config)


def remove_version(path: str | Path) -> None:
    """Delete a version directory: only its links and its own two files go, never the base's files."""
    path = Path(path)
    if not path.exists():
        return
    for entry in path.iterdir():
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
        else:
            shutil.rmtree(entry)  # MAR-INF, ours
    path.rmdir()


def unregister_every_version(client: "ManagementClient", store: str | Path, model: str, keep: str | None = None,
                             on_error: Callable[[str], None] | None = None) -> None:
    """Unregister every version of `model` (the default last: TorchServe refuses it while
    others exist) and delete the version directories they were served from, except `keep`
    (the base archive's URL); a failed unregister goes to `on_error` (raised without one).
    Nothing registered: nothing done."""
    try:
        described = client.describe_all(model)
    except TorchServeError:
        return  # never registered, or gone already
    try:
        default = client.describe(model)["modelVersion"]
    except TorchServeError:
        default = None
    for d in sorted(described, key=lambda d: d["modelVersion"] == default):
        try:
            client.unregister(model, d["modelVersion"])
        except TorchServeError as exc:
            if on_error is None:
                raise
            on_error(f"unregister {model} {d['modelVersion']} failed: {exc}")
        path = Path(store) / d["modelUrl"]
        if path.name != keep and (path / MANIFEST).exists() and load_version(path):
            remove_version(path)

"""A per-machine cache of what building an execution mode produces.

A swap starts new workers, and each worker used to build its mode from
scratch: export ONNX, compile it for OpenVINO, trace and freeze TorchScript,
run the accuracy guard. Those results depend only on the archive's content,
the mode, the thread count and the library versions, so the first worker
builds them once into a directory keyed by exactly that, and every later
worker (the next version of the same model, a worker TorchServe restarts)
loads them.

    archive_digest(model_dir)                  sha256 of the archive's content
    artifact_dir(model_dir, mode, threads, extra) -> the key's directory
    build_once(key_dir, build)                 build into it once, atomically

Keying (never a stale build): the key is a sha256 over the archive digest, the
mode, the thread count, the versions of torch/openvino/onnxruntime, the CPU
(model name and flags: a compiled graph is ISA-specific) and `extra` (what
the caller builds, e.g. "onnx" or "guard"). The archive digest covers every
file's relative name and content (its sha256, memoised per file), symlinks
followed (a Packrat version directory links its base's files). The one file read semantically is the
archive's model_config.yaml: the keys a swap writes per version (batchSize,
maxBatchDelay, min/maxWorkers, packrat.plan_id/base/slots/plan) and the mode
(keyed separately) are left out, so every version of one base in one mode
shares one build; every other key (max_length, guard thresholds, ...) is in.
MAR-INF (the per-version manifest), __pycache__, *.pyc and the cache itself
are skipped.

Where: $PACKRAT_BUILD_CACHE if set, else `.packrat-build-cache/` in the
directory that holds the model directory, symlinks resolved (TorchServe gives
a worker a symlink to it under its temp dir; the model store: the controller
writes version directories there, so the workers, who run as the same user,
can write too; TorchServe's scan of the store skips hidden entries). If that
is not writable, `$TMPDIR/packrat-build-cache-<uid>`. The root and every
entry are 0700, and a root that is a symlink, another user's or writable by
others is refused (a TorchScript file is code: nobody else may plant one).

Completeness: a build happens in a temporary directory beside the key's,
under a file lock (filelock) so concurrent workers build once; every file is
fsynced and its sha256 recorded in the entry's manifest, a marker file is
written last, the directory renamed into place and its parent fsynced, so a
key directory exists only complete, even after a crash. A failed build removes
its temporary directory and raises; nothing is left behind.

Trust (cache_entries.py): an entry is used only after its files match the
manifest (size + sha256, memoised per file stamp like the archive's files); a
mismatch, or a hit whose files fail to load (runner.load_cached), removes the
entry and builds it once more. A worker holds the entries it loaded (a shared
lock) and stamps their last use. After each build the cache is cut to its cap
($PACKRAT_BUILD_CACHE_MAX_MB, default 4096), least recently used first,
never an entry in use or being built.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packrat import settings
from packrat.modes import library_versions
from packrat_tasks import cache_entries

log = logging.getLogger(__name__)

DEFAULT_NAME = ".packrat-build-cache"
COMPLETE = cache_entries.COMPLETE  # written last inside a build; a key dir without it is not used
KEY_FILE = "key.json"  # the key in clear, for a human looking at the cache
# Files and directories that never enter the digest.
SKIP_DIRS = {"__pycache__", "MAR-INF", DEFAULT_NAME, ".git"}
SKIP_SUFFIXES = (".pyc", ".pyo")
CONFIG = "model_config.yaml"
# model_config.yaml keys a Packrat version writes per swap: they do not change what a mode builds.
PER_VERSION_KEYS = ("batchSize", "maxBatchDelay", "minWorkers", "maxWorkers")
PER_VERSION_PACKRAT_KEYS = ("plan_id", "base", "slots", "plan", "precision", "runtime")
LIBRARIES = ("torch", "openvino", "onnxruntime", "transformers", "intel-extension-for-pytorch")

MEMO_SETTLE_S = 2.0  # file_digest: a file changed this recently is hashed, never memoised
_digests: dict[str, str] = {}  # realpath of a model dir -> digest, for the life of this process


# -- the archive's identity ------------------------------------------------------


def _canonical_config(config: dict[str, Any]) -> bytes:
    """A model_config mapping as canonical JSON without the per-version keys."""
    config = {k: v for k, v in config.items() if k not in PER_VERSION_KEYS}
    section = config.get("packrat")
    if isinstance(section, dict):
        config["packrat"] = {k: v for k, v in section.items() if k not in PER_VERSION_PACKRAT_KEYS}
    return json.dumps(config, sort_keys=True, default=str).encode()


def _config_bytes(path: Path) -> bytes:
    """model_config.yaml as canonical JSON without the per-version keys."""
    import yaml

    config = yaml.safe_load(path.read_text()) or {}
    if not isinstance(config, dict):
        return path.read_bytes()
    return _canonical_config(config)


def config_digest(config: dict[str, Any] | None) -> str:
    """sha256 of the config a mode is built from, as the worker holds it in memory (the
    file is in archive_digest; an in-process caller may pass a changed copy)."""
    return hashlib.sha256(_canonical_config(dict(config or {}))).hexdigest()


def _files(root: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of every file under root, symlinks followed, sorted by name."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if name.endswith(SKIP_SUFFIXES):
                continue
            path = Path(dirpath) / name
            out.append((path.relative_to(root).as_posix(), path))
    return sorted(out)


def archive_digest(model_dir: str) -> str:
    """sha256 over the archive's files: relative names and contents (see the module doc).

    Each file enters as its size and its own sha256 (file_digest), so the hash of
    a weight file is memoised per file, not per archive directory: every swap
    writes a new version directory whose symlinks lead to the same base files,
    and a per-directory memo missed on every one (BERT-base's 440 MB: ~0.3 s of
    CPU per new worker). model_config.yaml enters as its canonical bytes.
    Memoised per process by directory.
    """
    real = os.path.realpath(model_dir)
    if real in _digests:
        return _digests[real]
    memo_dir = _memo_dir(real)
    h = hashlib.sha256()
    for rel, path in _files(Path(real)):
        h.update(rel.encode() + b"\0")
        if rel == CONFIG:
            data = _config_bytes(path)
            h.update(len(data).to_bytes(8, "little") + data)
            continue
        size, sha = file_digest(path, memo_dir)
        h.update(size.to_bytes(8, "little") + sha)
    digest = h.hexdigest()
    _digests[real] = digest
    return digest


def file_digest(path: Path, memo_dir: Path | None) -> tuple[int, bytes]:
    """(size, sha256) of one file, memoised across processes in `memo_dir`.

    The memo is keyed by the file's real path and used only while its size,
    inode, device, mtime and ctime are what they were when it was hashed: a
    write changes the ctime, which no user call can set back. Racy stamps (git's
    word): file times have a clock tick's granularity, so a file written again
    within the tick of its last change could keep its stamp; a file is memoised
    only once its last change is MEMO_SETTLE_S old and if it did not change
    while it was hashed.
    """
    real = os.path.realpath(path)
    stamp = _stamp(real)
    memo = None if memo_dir is None else memo_file(memo_dir, real)
    sha = _read_memo(memo, real, stamp)
    if sha is None:
        sha = _hash_file(real)
        settled = time.time_ns() - max(stamp[3], stamp[4]) > MEMO_SETTLE_S * 1e9
        if settled and _stamp(real) == stamp:
            _write_memo(memo, real, stamp, sha)
    return stamp[0], sha


def memo_file(memo_dir: Path, real: str) -> Path:
    """Where file_digest memoises the file at real path `real`."""
    return memo_dir / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")


def _hash_file(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.digest()


def _stamp(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


def _memo_dir(real: str) -> Path | None:
    try:
        return cache_root(real) / "digests"
    except OSError:
        return None


def _read_memo(memo: Path | None, real: str, stamp: list[int]) -> bytes | None:
    if memo is None:
        return None
    try:
        data = json.loads(memo.read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(data, dict) and data.get("path") == real and data.get("stamp") == stamp
          and isinstance(data.get("sha256"), str))
    try:
        return bytes.fromhex(data["sha256"]) if ok else None
    except ValueError:
        return None


def _write_memo(memo: Path | None, real: str, stamp: list[int], sha: bytes) -> None:
    if memo is None:
        return
    try:
        memo.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"path": real, "stamp": stamp, "sha256": sha.hex()}))
        os.replace(tmp, memo)  # atomic: a reader sees the old memo or the new one
    except OSError as exc:
        log.warning("build cache: could not memoise a file digest (%s)", exc)


@functools.cache  # per process: a worker's libraries and CPU do not change under it
def _versions() -> dict[str, str | None]:
    return library_versions(LIBRARIES)


@functools.cache
def _cpu() -> dict[str, str]:
    """The CPU's model name and a hash of its flags (compiled graphs are ISA-specific)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = " ".join(sorted(value.split()))
                if model and flags:
                    break
    except OSError:
        pass
    return {"model": model, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


# -- where -----------------------------------------------------------------------


def _secure_root(path: Path) -> Path:
    """Create `path` 0700 or accept it if it is a private directory of this user."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"build cache {path} is not a directory (a symlink?)")
    if st.st_uid != os.getuid():
        raise PermissionError(f"build cache {path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o022:
        raise PermissionError(f"build cache {path} is writable by other users")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"build cache {path} is not writable")
    return path


def cache_root(model_dir: str) -> Path:
    """$PACKRAT_BUILD_CACHE, else `.packrat-build-cache/` beside the model directory."""
    given = settings.value("build_cache")
    if given is not None:
        return _secure_root(given)  # the operator chose it: an error is an error
    # realpath: TorchServe 0.12 hands a worker `<tmp>/models/<uuid>/<name>`, a symlink
    # to the directory in the model store, and a new uuid per registration.
    beside = Path(os.path.realpath(model_dir)).parent / DEFAULT_NAME
    try:
        return _secure_root(beside)
    except OSError as exc:
        fallback = Path(tempfile.gettempdir()) / f"packrat-build-cache-{os.getuid()}"
        log.warning("build cache: %s unusable (%s); using %s", beside, exc, fallback)
        return _secure_root(fallback)


def cache_key(model_dir: str, mode: str, threads: int | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a build depends on, as a JSON-able dict."""
    return {
        "archive": archive_digest(model_dir),
        "mode": mode,
        "threads": threads,
        "versions": dict(_versions()),
        "cpu": dict(_cpu()),
        "extra": extra or {},
    }


def artifact_dir(model_dir: str, mode: str, threads: int | None = None,
                 extra: dict[str, Any] | None = None) -> Path:
    """The cache directory of (archive content, mode, threads, library versions, CPU, extra).

    Not created: build_once() creates it complete or not at all.
    """
    key = cache_key(model_dir, mode, threads, extra)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    what = str((extra or {}).get("what", "build"))
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{mode}-{what}-t{threads}")
    return cache_root(model_dir) / f"{safe}-{digest[:24]}"


# -- building once ----------------------------------------------------------------


def is_complete(key_dir: Path) -> bool:
    """The marker is there (cheap; use() checks the files too)."""
    return (key_dir / COMPLETE).is_file()


def use(key_dir: Path) -> bool:
    """Hold the entry and check its files against its manifest; a damaged entry is
    removed (False: build it again). True: load it."""
    key_dir = Path(key_dir)
    if not is_complete(key_dir) or not cache_entries.hold(key_dir):
        return False
    # Hashes memoised per file stamp (file_digest) beside the archives' (a hit: a stat per file).
    why = cache_entries.verify(key_dir, lambda path: file_digest(path, key_dir.parent / "digests"))
    if why is not None:
        cache_entries.discard(key_dir, why, only_held=True)
        return False
    return True


def discard(key_dir: Path, why: str) -> None:
    """Remove the entry this process holds because it failed to load (runner.load_cached
    builds it once more); left alone if another worker replaced it meanwhile."""
    cache_entries.discard(Path(key_dir), why, only_held=True)


def build_id(key_dir: Path) -> str:
    """The id of the build an entry holds (new per build): a verdict on it names it."""
    return cache_entries.manifest_id(Path(key_dir))


def entry_file(key_dir: Path, name: str) -> Path:
    """A file an entry names in a pointer: a plain name it holds (ValueError otherwise)."""
    return cache_entries.entry_file(Path(key_dir), name)


def cap_bytes() -> int:
    return int(settings.value("build_cache_max_mb") * 1024 * 1024)


def _sealing_digest(path: Path) -> tuple[int, bytes]:
    return os.lstat(path).st_size, _hash_file(str(path))


def build_once(key_dir: Path, build: Callable[[Path], None],
               key: dict[str, Any] | None = None, replace: bool = False) -> Path:
    """Return `key_dir` holding a complete build, building it first if needed.

    `build(tmp)` writes its files into `tmp` (an empty 0700 directory beside
    key_dir). Under a file lock, so of several processes asking at once one
    builds and the others wait, then load. The marker is written after
    build() returns and the directory renamed into place (atomic), so a
    reader sees a complete build or none. If build() raises, its directory
    is removed and the exception propagates. An existing entry is kept if its
    files match its manifest, else rebuilt; `replace`: rebuilt in any case
    (a new verdict for the same key). The cache is then cut to its cap.
    """
    from filelock import FileLock

    key_dir = Path(key_dir)
    if not replace and use(key_dir):
        return key_dir
    key_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with FileLock(str(key_dir) + ".lock"):
        if not replace and use(key_dir):  # built by another process while we waited
            return key_dir
        if key_dir.exists() or key_dir.is_symlink():  # damaged, half or replaced: never trusted
            cache_entries.discard(key_dir, "replaced by a new build" if replace else "incomplete",
                                  logging.INFO if replace else logging.WARNING)
        tmp = key_dir.parent / f".{key_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        os.mkdir(tmp, 0o700)
        try:
            build(tmp)
            if key is not None:
                (tmp / KEY_FILE).write_text(json.dumps(key, indent=1, sort_keys=True, default=str))
            cache_entries.seal(tmp, _sealing_digest)
            os.rename(tmp, key_dir)
            cache_entries.fsync_dir(key_dir.parent)  # the rename itself survives a crash
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        cache_entries.hold(key_dir)
    cache_entries.enforce_cap(key_dir.parent, cap_bytes(), keep=key_dir)
    return key_dir


def cached_build(model_dir: str, mode: str, build: Callable[[Path], None], *,
                 threads: int | None = None, extra: dict[str, Any] | None = None) -> tuple[Path, bool]:
    """artifact_dir() + build_once(); returns (directory, hit) where hit means nothing was built here."""
    key_dir = artifact_dir(model_dir, mode, threads, extra)
    if use(key_dir):
        return key_dir, True
    built = False

    def run(tmp: Path) -> None:
        nonlocal built
        built = True
        build(tmp)

    out = build_once(key_dir, run, key=cache_key(model_dir, mode, threads, extra))
    return out, not built


__all__ = ["archive_digest", "artifact_dir", "build_id", "build_once", "cache_key", "cache_root", "cached_build",
           "cap_bytes", "config_digest", "discard", "entry_file", "is_complete", "use"]

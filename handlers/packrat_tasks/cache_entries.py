"""One build-cache entry on disk: made durable, checked before use, held while used, evicted.

    seal(tmp)                     fsync every file, record their sha256 in manifest.json
    verify(key_dir, digest)       None if every file of the manifest is there with its hash, else why
    hold(key_dir)                 a shared lock on the entry for this process's life + its LRU stamp
    discard(key_dir, why)         remove a damaged entry (renamed away first: readers see it whole or gone)
    enforce_cap(root, cap, keep)  evict least recently used entries nobody holds until under `cap` bytes
    entry_file(key_dir, name)     a file the entry names (a pointer): a plain name, a file of the manifest

Why (a build cache is loaded by every worker of its archive and mode): without
fsync before the rename that completes an entry, a crash can leave a complete-
looking entry with a truncated file; without hashes, a damaged file is loaded
forever and every worker and every swap to it fails. The manifest is written
last, before the marker; verify() compares sizes and sha256 (memoised per file
stamp by the caller's `digest`, so a hit costs a stat per file). Its `build` id
is new per build: what was judged for one build (the guard's verdict) names it.

Held entries: a worker takes a shared flock on `<entry>/.in-use` when it loads
the entry and keeps it until it exits; eviction takes the lock exclusively
without waiting and skips an entry it cannot take (in use), and never looks at
temporary build directories younger than STALE_TMP_S. The lock file's mtime is
the entry's last use (atime is unreliable: noatime, relatime).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"  # {"build": id, "files": {relative name: {"size", "sha256"}}}
IN_USE = ".in-use"  # flock'ed shared by every process using the entry; its mtime = last use
COMPLETE = ".complete"  # written last inside a build (after the manifest)
NOT_HASHED = {MANIFEST, IN_USE, COMPLETE}
STALE_TMP_S = 3600.0  # a temporary build directory this old belongs to a builder that died
SKIP = {"digests"}  # the root's own directories that are not entries

_held: dict[str, int] = {}  # key_dir -> fd holding the shared lock, for this process's life

Digest = Callable[[Path], tuple[int, bytes]]  # (size, sha256) of a file


def _fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entry_files(root: Path) -> list[Path]:
    """Every regular file below root except the bookkeeping ones, symlinks refused."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.parent == root and name in NOT_HASHED:
                continue
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"build cache: {path} is not a regular file")
            out.append(path)
    return out


def seal(tmp: Path, digest: Digest) -> str:
    """Make a finished build in `tmp` durable and self-checking: every file fsynced and
    hashed into the manifest, the marker written, the directory fsynced. The caller
    renames `tmp` into place and fsyncs the parent (fsync_dir). Returns the build id."""
    files = {}
    for path in _entry_files(tmp):
        _fsync_path(path)
        size, sha = digest(path)
        files[path.relative_to(tmp).as_posix()] = {"size": size, "sha256": sha.hex()}
    build = uuid.uuid4().hex
    for name, text in ((MANIFEST, json.dumps({"build": build, "files": files}, indent=1, sort_keys=True)),
                       (COMPLETE, f"{os.getpid()}\n"), (IN_USE, "")):
        with open(tmp / name, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    for dirpath, _, _ in os.walk(tmp):  # the directory entries too: a name can be lost like data
        fsync_dir(Path(dirpath))
    return build


def fsync_dir(path: Path) -> None:
    _fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)


def manifest(key_dir: Path) -> dict:
    data = json.loads((key_dir / MANIFEST).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or not data.get("build"):
        raise ValueError("malformed manifest")
    return data


def manifest_id(key_dir: Path) -> str:
    """The build id of the entry: what a verdict about its files names."""
    return str(manifest(key_dir)["build"])


def verify(key_dir: Path, digest: Digest) -> str | None:
    """None when every file the manifest lists is a regular file of its size and sha256."""
    try:
        files = manifest(key_dir)["files"]
    except (OSError, ValueError) as exc:
        return f"no usable {MANIFEST} ({exc})"
    for rel, want in files.items():
        path = key_dir / rel
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                return f"{rel} is not a regular file"
            if st.st_size != want.get("size"):
                return f"{rel} is {st.st_size} bytes, was {want.get('size')} (truncated?)"
            if digest(path)[1].hex() != want.get("sha256"):
                return f"{rel}: sha256 differs from the one recorded when it was built"
        except OSError as exc:
            return f"{rel}: {exc}"
    return None


def hold(key_dir: Path) -> bool:
    """Take (once per process) a shared lock on the entry and stamp its last use.

    False when the entry went away (evicted or discarded) before the lock was had:
    the caller builds it again. The lock is held until this process exits.
    """
    key = str(key_dir)
    lock = key_dir / IN_USE
    if key in _held:
        try:
            same = os.path.samestat(os.fstat(_held[key]), os.lstat(lock))
        except OSError:
            same = False
        if same:
            _touch(lock)
            return True
        os.close(_held.pop(key))  # the entry was replaced: hold the new one
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)  # an evictor holds it exclusively only while renaming
    try:
        still_there = os.path.samestat(os.fstat(fd), os.lstat(lock)) and (key_dir / COMPLETE).is_file()
    except OSError:
        still_there = False
    if not still_there:
        os.close(fd)
        return False
    _held[key] = fd
    _touch(lock)
    return True


def _touch(lock: Path) -> None:
    try:
        os.utime(lock)
    except OSError:  # a read-only cache can still be used; LRU then sees its build time
        pass


def _remove(key_dir: Path) -> None:
    """Rename away (atomic: nobody sees half an entry), then delete."""
    trash = key_dir.parent / f".{key_dir.name}.trash-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        os.rename(key_dir, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def discard(key_dir: Path, why: str, level: int = logging.WARNING, only_held: bool = False) -> None:
    """Remove a damaged entry, whoever holds it (they loaded it already; it is not loaded again).

    `only_held`: only if it is still the entry this process holds. A worker that found
    damage while hashing must not remove the entry another worker rebuilt meanwhile.
    """
    held = _held.pop(str(key_dir), None)
    try:
        if only_held and (held is None or not os.path.samestat(os.fstat(held), os.lstat(key_dir / IN_USE))):
            return
    except OSError:
        return  # gone already
    finally:
        if held is not None:
            os.close(held)
    log.log(level, "build cache: removing %s: %s", key_dir, why)
    _remove(key_dir)


def entry_file(key_dir: Path, name: str) -> Path:
    """The file `name` (read from a pointer file of the entry) must be a plain name of a
    file the manifest lists: no path, no '..', no symlink out of the entry."""
    name = name.strip()
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"build cache: {key_dir} points to {name!r}, not a plain file name")
    if name not in manifest(key_dir)["files"]:
        raise ValueError(f"build cache: {key_dir} points to {name!r}, which it does not hold")
    return key_dir / name


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _last_use(entry: Path) -> float:
    try:
        return os.lstat(entry / IN_USE).st_mtime
    except OSError:
        return os.lstat(entry).st_mtime


def _try_evict(entry: Path) -> bool:
    """Remove `entry` unless a process holds it (or it has no lock file: then it is removed)."""
    try:
        fd = os.open(entry / IN_USE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        _remove(entry)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        _remove(entry)
    finally:
        os.close(fd)
    return True


def _sweep_stale(root: Path, now: float) -> None:
    """Temporary build and trash directories of processes that died mid-way."""
    for path in root.iterdir():
        if path.name.startswith(".") and (".tmp-" in path.name or ".trash-" in path.name):
            try:
                if now - os.lstat(path).st_mtime > STALE_TMP_S:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass


def enforce_cap(root: Path, cap: int, keep: Path | None = None) -> list[str]:
    """Evict entries, least recently used first, until the complete entries (+ digest
    memos) take at most `cap` bytes; an entry held by a process and `keep` (just
    built) are never evicted. Returns the evicted names."""
    now = time.time()
    _sweep_stale(root, now)
    entries = [p for p in root.iterdir()
               if not p.name.startswith(".") and p.name not in SKIP and p.is_dir() and not p.is_symlink()]
    sizes = {p: _size(p) for p in entries}
    total = sum(sizes.values()) + sum(_size(root / d) for d in SKIP)
    evicted = []
    for entry in sorted(entries, key=_last_use):
        if total <= cap:
            break
        if keep is not None and entry == keep:
            continue
        if _try_evict(entry):
            total -= sizes[entry]
            evicted.append(entry.name)
    if evicted:
        log.info("build cache over %d bytes: evicted %s", cap, ", ".join(evicted))
    if total > cap:
        log.warning("build cache %s holds %d bytes, over its cap of %d: the rest is in use", root, total, cap)
    return evicted


__all__ = ["COMPLETE", "IN_USE", "MANIFEST", "discard", "enforce_cap", "entry_file", "fsync_dir", "hold",
           "manifest", "manifest_id", "seal", "verify"]

"""Where profiles live, and whether one may be used now.

    <state dir>/profiles/<model>/<mode>.json   one profile per execution mode: written by
                                               `packrat profile` (its default), the
                                               controller's tune and profile jobs
    <state dir>/profiles/<model>.json          a profile placed by hand (the older layout):
                                               used as it is, for the archive's own mode
    <state dir>/profiles/<model>/shapes/<mode>/<kind>-<size>[_...].json
                                               profiles kept per input shape (keep()): the
                                               one planned from before the traffic moved;
                                               kept_covering() finds one for the traffic's
                                               sizes and restore() plans from it again

The state dir is `.packrat` unless told otherwise (`make run`, `packrat
controller`, `packrat profile` share it). A per-mode profile is used only
when, checked at the moment of use,
  - its model_id is the content hash of the base archive as it is now,
  - its fingerprint is the one this machine gives that archive in that mode
    (CPU, usable cores, allocator, torch version, mode),
  - it is complete and timed the whole handler (scope "handler");
otherwise it is stale: the mode is re-profiled, never planned from.

Hashing a full-size archive reads every weight (~1 s for BERT-base), so
hashes are cached per directory and recomputed when any file's size or
mtime changes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from packrat import settings
from packrat.errors import ProfileError
from packrat.profile import shape
from packrat.profile.fingerprint import config_in_mode, current_fingerprint, differences, mode_from_config
from packrat.profile.identity import CONFIG_NAME, _skipped, content_hash, read_config_file
from packrat.profile.store import load_profile, save_profile
from packrat.types import Fingerprint, Profile

DEFAULT_STATE_DIR: Path = settings.get("state_dir").default


def profiles_dir(state_dir: str | Path, model: str) -> Path:
    return Path(state_dir) / "profiles" / model


def profile_file(state_dir: str | Path, model: str, mode: str) -> Path:
    """Where the profile of `model` in `mode` lives."""
    return profiles_dir(state_dir, model) / f"{mode}.json"


def legacy_profile_file(state_dir: str | Path, model: str) -> Path:
    return Path(state_dir) / "profiles" / f"{model}.json"


class ArchiveHashes:
    """content_hash() per directory, recomputed only when a file's size or mtime changes."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[tuple, str]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _signature(directory: Path) -> tuple:
        out = []
        for p in directory.rglob("*"):
            rel = p.relative_to(directory)
            if _skipped(rel) or not p.is_file():
                continue
            st = p.stat()
            out.append((rel.as_posix(), st.st_size, st.st_mtime_ns))
        return tuple(sorted(out))

    def __call__(self, directory: str | Path) -> str:
        d = Path(directory).resolve()
        sig = self._signature(d)
        with self._lock:
            hit = self._cache.get(d)
            if hit is not None and hit[0] == sig:
                return hit[1]
        value = content_hash(d)
        with self._lock:
            self._cache[d] = (sig, value)
        return value


HASHES = ArchiveHashes()


@dataclass(frozen=True)
class Checked:
    """One per-mode profile file and whether it may be used now."""

    mode: str
    path: Path
    profile: Profile | None  # None: missing, unreadable or stale
    problems: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        return self.profile is not None and not self.problems


_read_cache: dict[Path, tuple[tuple[int, int], Profile]] = {}
_read_lock = threading.Lock()


def _read(path: Path) -> Profile:
    """load_profile, cached while the file's mtime and size stay the same."""
    st = path.stat()
    key = (st.st_mtime_ns, st.st_size)
    with _read_lock:
        hit = _read_cache.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
    prof = load_profile(path)
    with _read_lock:
        _read_cache[path] = (key, prof)
    return prof


_machine: list = []  # [(monotonic time, Fingerprint of this machine)]
_MACHINE_TTL_S = 10.0


def expected_fingerprint(config: dict, mode: str) -> Fingerprint:
    """current_fingerprint(config in `mode`); the machine's part (CPU, cores, allocator,
    torch, ~4 ms to read) is reused for a few seconds: the re-plan loop checks every
    mode's profile every tick."""
    now = time.monotonic()
    if not _machine or now - _machine[0][0] > _MACHINE_TTL_S:
        _machine[:] = [(now, current_fingerprint({}))]
    return replace(_machine[0][1], mode=mode_from_config(config_in_mode(config, mode)))


def base_config(base_dir: str | Path) -> dict:
    path = Path(base_dir) / CONFIG_NAME
    return read_config_file(path) if path.is_file() else {}


def check_mode_profile(path: str | Path, mode: str, model_id: str, config: dict,
                       cores: int | None = None) -> Checked:
    """Is the profile at `path` usable for the archive (`model_id`, its `config`) in `mode`?

    `cores`: it must also have points at every thread count 1..cores.
    """
    path = Path(path)
    if not path.exists():
        return Checked(mode, path, None, ("not profiled",))
    try:
        prof = _read(path)
    except (OSError, ProfileError) as exc:
        return Checked(mode, path, None, (f"unreadable: {exc}",))
    problems: list[str] = []
    if prof.model_id != model_id:
        problems.append(f"archive changed (model_id {prof.model_id[:19]}… != {model_id[:19]}…)")
    expected = expected_fingerprint(config, mode)
    if prof.fingerprint is None:
        problems.append("no fingerprint")
    else:
        problems.extend(differences(prof.fingerprint, expected))
    if not prof.extra.get("complete", True):
        problems.append("incomplete (a run was interrupted)")
    if prof.scope != "handler":
        problems.append(f"scope {prof.scope!r} (tuning needs 'handler')")
    if cores is not None and not set(range(1, cores + 1)) <= {p.threads for p in prof.points}:
        problems.append(f"thread counts {sorted({p.threads for p in prof.points})} do not cover 1..{cores}")
    if not prof.points:
        problems.append("no points")
    return Checked(mode, path, None if problems else prof, tuple(problems))


def mode_profiles(state_dir: str | Path, model: str, base_dir: str | Path,
                  hashes: ArchiveHashes = HASHES) -> list[Checked]:
    """Every per-mode profile of `model`, checked against its base archive now (sorted by mode)."""
    directory = profiles_dir(state_dir, model)
    if not directory.is_dir():
        return []
    files = sorted(p for p in directory.glob("*.json") if not p.name.startswith("."))
    if not files:
        return []
    model_id = hashes(base_dir)
    config = base_config(base_dir)
    return [check_mode_profile(p, p.stem, model_id, config) for p in files]


def usable_profiles(state_dir: str | Path, model: str, base_dir: str | Path,
                    hashes: ArchiveHashes = HASHES) -> tuple[Profile, ...]:
    """The per-mode profiles of `model` that may be planned from now."""
    return tuple(c.profile for c in mode_profiles(state_dir, model, base_dir, hashes)
                 if c.usable and c.profile is not None)


def default_state_dir() -> Path:
    """PACKRAT_STATE_DIR if set, else .packrat (relative to the working directory)."""
    return settings.value("state_dir")


# -- profiles kept per input shape --------------------------------------------------------


def kept_dir(state_dir: str | Path, model: str, mode: str) -> Path:
    return profiles_dir(state_dir, model) / "shapes" / mode


def shape_label(sizes: dict[str, int]) -> str:
    """A file stem for the sizes a profile was timed at: "tokens-128", "pixels-50176_tokens-6"."""
    return "_".join(f"{kind}-{size}" for kind, size in sorted(sizes.items()))


def keep(profile: Profile, state_dir: str | Path, model: str, mode: str) -> Path | None:
    """Keep `profile` (the one planned from until the traffic moved) for its input shape;
    a kept profile of a shape within the shift factor either way of it is replaced (the
    newer measures the same shape). None: its sizes are not known, so no traffic can find it."""
    sizes = shape.timed_sizes(profile)
    if not sizes:
        return None
    directory = kept_dir(state_dir, model, mode)
    for old in directory.glob("*.json") if directory.is_dir() else ():
        try:
            other = shape.timed_sizes(_read(old))
        except (OSError, ProfileError):
            other = sizes  # unreadable: nothing worth keeping
        if not shape.shifted(sizes, other) and not shape.shifted(other, sizes):
            old.unlink(missing_ok=True)
    path = directory / f"{shape_label(sizes)}.json"
    save_profile(profile, path)
    return path


def kept_covering(state_dir: str | Path, model: str, mode: str, base_dir: str | Path, sizes: dict[str, int],
                  hashes: ArchiveHashes = HASHES) -> Checked | None:
    """The kept profile of `model` in `mode` whose timed sizes cover `sizes` (the same
    factor packrat.profile.shape.shifted applies) and that is usable for the base archive
    and this machine now (check_mode_profile); the nearest when several do; None if none."""
    directory = kept_dir(state_dir, model, mode)
    files = sorted(directory.glob("*.json")) if directory.is_dir() and sizes else []
    if not files:
        return None
    model_id, config = hashes(base_dir), base_config(base_dir)
    found: list[tuple[float, Checked]] = []
    for path in files:
        checked = check_mode_profile(path, mode, model_id, config)
        made_at = shape.timed_sizes(checked.profile)
        if checked.usable and made_at and not shape.shifted(made_at, sizes):
            far = max(max(made_at[k], v) / max(1, min(made_at[k], v)) for k, v in sizes.items())
            found.append((far, checked))
    return min(found, key=lambda f: f[0])[1] if found else None


def restore(kept: Checked, state_dir: str | Path, model: str) -> Path:
    """Make the kept profile the one `model` is planned from in its mode (the per-mode file
    the planner and the re-plan loop read), as a byte copy written atomically."""
    out = profile_file(state_dir, model, kept.mode)
    tmp = out.with_name(f".{out.name}.restore")
    tmp.write_bytes(kept.path.read_bytes())
    tmp.replace(out)
    return out

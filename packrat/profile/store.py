"""Profile files: one JSON object per profile, format "packrat-profile/1".

    {
      "format": "packrat-profile/1",
      "model_id": "sha256:<hex>",          # archive content hash (profile.identity)
      "model_name": "bert-base",           # informational (MANIFEST modelName)
      "fingerprint": {                     # all five must match to use the profile
        "cpu_model": "AMD EPYC",
        "usable_cores": 2,
        "allocator": "glibc",             # glibc | glibc-tuned | jemalloc | tcmalloc
        "torch_version": "2.13.0",
        "mode": "fp32-eager"              # <precision>-<runtime> from model_config.yaml
      },
      "scope": "handler",                  # "handler": preprocess+forward+postprocess
                                           # "model":   forward() only
      "created": "2026-12-02T13:05:00Z",   # UTC, ISO 8601
      "complete": true,                    # false while a run is still going
      "settings": {...},                   # cores, max_batch, budgets, stop rule (informational)
      "duration_s": 312.4,                 # wall time of the whole run
      "points": [                          # sorted by (threads, batch)
        {"threads": 1, "batch": 1, "mean_ms": 41.2, "p50_ms": 41.0, "p99_ms": 45.3,
         "std_ms": 1.1, "count": 37,
         "meta": {"cpus_allowed_list": "0", "converged": true, "ci_half_width_ms": 0.4,
                  "warmup_calls": 3, "elapsed_s": 2.1, "torch_threads": 1,
                  "interop_threads": 1, "pid": 1234}}
      ],
      "omitted": [                         # configurations not measured, never invented
        {"threads": 1, "batch": 32, "reason": "total budget exhausted"}
      ],
      "figures": "isolated+co-run",        # what the figures mean (written, derived on read):
                                           # "isolated": points only, each instance timed alone
      "corun": [                           # uniform shapes <i, t>: all i instances at once,
        {"instances": 2, "threads": 1,     # each on its own pinned cores; mean_ms etc. are
         "batch": 4, "mean_ms": 47.9, ...} # the slowest instance's (it sets a plan's latency)
      ]
    }

Readers need only model_id, fingerprint, scope and points[*].{threads, batch,
mean_ms}; every other key is optional on read. A profile without "corun" (every
profile written before co-run profiling) loads as isolated-only, and says so
in Profile.figures. Unknown keys are ignored, so
fields can be added without a format bump; a change of meaning bumps the
version in "format".

`load_profile` also reads a plain CSV (a `.csv` file): a header with at least
threads,batch,latency_ms (milliseconds, the mean); other columns are ignored,
e.g. the paper's latency_min_ms/latency_max_ms. Such a profile has no
fingerprint: planning from it is a what-if question.

Every problem is a ProfileError naming the file (and line or point), so the
CLI can print one line.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from packrat.errors import ProfileError, ProfileMismatchError
from packrat.types import Fingerprint, Profile, ProfilePoint

FORMAT = "packrat-profile/1"
SCOPES = ("handler", "model")
_FINGERPRINT_FIELDS = ("cpu_model", "usable_cores", "allocator", "torch_version", "mode")


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _point_dict(p: ProfilePoint) -> dict[str, Any]:
    out = {"threads": p.threads, "batch": p.batch, "mean_ms": p.mean_ms, "p50_ms": p.p50_ms,
           "p99_ms": p.p99_ms, "std_ms": p.std_ms, "count": p.count, "meta": p.meta}
    if p.instances != 1:
        out = {"instances": p.instances, **out}
    return out


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    extra = dict(profile.extra)
    out: dict[str, Any] = {
        "format": FORMAT,
        "model_id": profile.model_id,
        "model_name": extra.pop("model_name", None),
        "fingerprint": asdict(profile.fingerprint) if profile.fingerprint else None,
        "scope": profile.scope,
        "created": extra.pop("created", None) or utc_now(),
        "complete": extra.pop("complete", True),
        "settings": extra.pop("settings", {}),
        "duration_s": extra.pop("duration_s", None),
        "points": [_point_dict(p) for p in sorted(profile.points, key=lambda p: (p.threads, p.batch))],
        "omitted": extra.pop("omitted", []),
        "figures": profile.figures,
        "corun": [_point_dict(p) for p in sorted(profile.corun, key=lambda p: (p.instances, p.threads, p.batch))],
    }
    out.update(extra)  # anything else a caller attached stays in the file
    return out


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write atomically (temp file + rename) so a reader never sees half a profile."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; a profile is meant to be shared
        with os.fdopen(fd, "w") as f:
            json.dump(profile_to_dict(profile), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _num(value: Any, what: str, kind: type = float, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{what} must be a number, got {value!r}")
    return kind(value)


def _point(raw: Any, i: int, where: str = "points") -> ProfilePoint:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}[{i}] must be an object")
    try:
        threads = _num(raw["threads"], f"{where}[{i}].threads", int)
        batch = _num(raw["batch"], f"{where}[{i}].batch", int)
        mean = _num(raw["mean_ms"], f"{where}[{i}].mean_ms")
    except KeyError as exc:
        raise ProfileError(f"{where}[{i}] lacks {exc.args[0]!r}") from exc
    if threads < 1 or batch < 1 or not (mean > 0 and math.isfinite(mean)):
        raise ProfileError(f"{where}[{i}]: threads and batch must be >= 1 and mean_ms > 0")
    instances = _num(raw.get("instances", 1), f"{where}[{i}].instances", int)
    if (instances < 2) if where == "corun" else (instances != 1):
        raise ProfileError(f"{where}[{i}].instances must be {'>= 2' if where == 'corun' else '1'}")
    return ProfilePoint(
        threads=threads,
        batch=batch,
        mean_ms=mean,
        p50_ms=_num(raw.get("p50_ms"), f"points[{i}].p50_ms", optional=True),
        p99_ms=_num(raw.get("p99_ms"), f"points[{i}].p99_ms", optional=True),
        std_ms=_num(raw.get("std_ms"), f"points[{i}].std_ms", optional=True),
        count=_num(raw.get("count"), f"points[{i}].count", int, optional=True),
        instances=instances,
        meta=dict(raw.get("meta") or {}),
    )


def _fingerprint(raw: Any) -> Fingerprint | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or any(k not in raw for k in _FINGERPRINT_FIELDS):
        raise ProfileError(f"fingerprint must be an object with {', '.join(_FINGERPRINT_FIELDS)}")
    return Fingerprint(
        cpu_model=str(raw["cpu_model"]),
        usable_cores=_num(raw["usable_cores"], "fingerprint.usable_cores", int),
        allocator=str(raw["allocator"]),
        torch_version=str(raw["torch_version"]),
        mode=str(raw["mode"]),
    )


def profile_from_dict(data: Any) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError("a profile file must hold one JSON object")
    fmt = data.get("format", FORMAT)
    if fmt != FORMAT:
        raise ProfileError(f"unsupported profile format {fmt!r} (this Packrat reads {FORMAT!r})")
    if not isinstance(data.get("model_id"), str) or not data["model_id"]:
        raise ProfileError("model_id is missing")
    scope = data.get("scope", "handler")
    if scope not in SCOPES:
        raise ProfileError(f"scope must be one of {SCOPES}, got {scope!r}")
    raw_points = data.get("points")
    if not isinstance(raw_points, list):
        raise ProfileError("points must be a list")
    points = tuple(_point(p, i) for i, p in enumerate(raw_points))
    seen = set()
    for p in points:
        if (p.threads, p.batch) in seen:
            raise ProfileError(f"duplicate point threads={p.threads} batch={p.batch}")
        seen.add((p.threads, p.batch))
    raw_corun = data.get("corun") or []
    if not isinstance(raw_corun, list):
        raise ProfileError("corun must be a list")
    corun = tuple(_point(p, i, "corun") for i, p in enumerate(raw_corun))
    if len({(p.instances, p.threads, p.batch) for p in corun}) != len(corun):
        raise ProfileError("duplicate corun point")
    known = {"format", "model_id", "fingerprint", "scope", "points", "corun", "figures"}
    extra = {k: v for k, v in data.items() if k not in known}
    extra.setdefault("omitted", [])
    return Profile(
        model_id=data["model_id"],
        points=points,
        fingerprint=_fingerprint(data.get("fingerprint")),
        scope=scope,
        corun=corun,
        extra=extra,
    )


def check_profile(
    profile: Profile,
    expect_model_id: str | None = None,
    expect_fingerprint: Fingerprint | None = None,
    force: bool = False,
    where: str = "profile",
) -> list[str]:
    """Mismatches between `profile` and what is expected; raise unless `force`.

    Returns the list of mismatch descriptions (empty when everything matches),
    so a forced caller can still warn about them.
    """
    from packrat.profile.fingerprint import differences  # no torch: safe anywhere

    problems: list[str] = []
    if expect_model_id is not None and profile.model_id != expect_model_id:
        problems.append(f"model_id: {profile.model_id!r} != {expect_model_id!r}")
    if expect_fingerprint is not None:
        if profile.fingerprint is None:
            problems.append("fingerprint: missing in the file")
        else:
            problems.extend(differences(profile.fingerprint, expect_fingerprint))
    if problems and not force:
        raise ProfileMismatchError(
            f"{where} was measured for another model or machine ({'; '.join(problems)}); "
            "re-profile, or force to use it anyway"
        )
    return problems


def load_profile(
    path: str | Path,
    expect_model_id: str | None = None,
    expect_fingerprint: Fingerprint | None = None,
    force: bool = False,
) -> Profile:
    """Read a profile file (JSON, or CSV for `.csv`); ProfileError if unreadable,
    ProfileMismatchError on mismatch unless forced."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise ProfileError(f"{path}: no such profile file") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{path}: cannot read: {exc}") from exc
        profile = _from_csv(text, path)
        check_profile(profile, expect_model_id, expect_fingerprint, force, where=str(path))
        return profile
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ProfileError(f"{path}: no such profile file") from exc
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ProfileError(f"{path}: not a readable JSON profile ({exc})") from exc
    try:
        profile = profile_from_dict(data)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    check_profile(profile, expect_model_id, expect_fingerprint, force, where=str(path))
    return profile


# -- CSV profiles ------------------------------------------------------------------

_CSV_COLUMNS = ("threads", "batch", "latency_ms")


def _int(value: Any, what: str, where: str) -> int:
    # bool is an int in Python; a profile saying threads=true is broken
    if isinstance(value, bool):
        raise ProfileError(f"{where}: {what} must be an integer, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: {what} must be an integer, got {value!r}") from None
    if not number.is_integer() or number < 1:
        raise ProfileError(f"{where}: {what} must be a positive integer, got {value!r}")
    return int(number)


def _ms(value: Any, what: str, where: str, required: bool = True) -> float | None:
    if value is None and not required:
        return None
    if isinstance(value, bool):
        raise ProfileError(f"{where}: {what} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: {what} must be a number, got {value!r}") from None
    # a mean must be > 0 (it is a latency); spreads such as std_ms may be 0
    if not math.isfinite(number) or number < 0 or (required and number == 0):
        raise ProfileError(f"{where}: {what} must be a positive number, got {value!r}")
    return number


def _check_unique(points: list[ProfilePoint], source: str) -> None:
    seen: set[tuple[int, int]] = set()
    for p in points:
        if (p.threads, p.batch) in seen:
            raise ProfileError(
                f"{source}: two points for threads={p.threads}, batch={p.batch}"
            )
        seen.add((p.threads, p.batch))


def _from_csv(text: str, path: Path) -> Profile:
    reader = csv.DictReader(text.splitlines())
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in _CSV_COLUMNS if c not in header]
    if missing:
        raise ProfileError(
            f"{path}: CSV lacks column(s) {', '.join(missing)} "
            f"(needs at least {','.join(_CSV_COLUMNS)})"
        )
    reader.fieldnames = header
    points: list[ProfilePoint] = []
    for line, row in enumerate(reader, start=2):
        if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
            continue  # blank line
        where = f"{path}:{line}"
        points.append(
            ProfilePoint(
                threads=_int(row["threads"], "threads", where),
                batch=_int(row["batch"], "batch", where),
                mean_ms=_ms(row["latency_ms"], "latency_ms", where),
            )
        )
    if not points:
        raise ProfileError(f"{path}: CSV has no data rows")
    _check_unique(points, str(path))
    return Profile(model_id=path.stem, points=tuple(points), fingerprint=None,
                   scope="unknown", extra={"source": str(path)})

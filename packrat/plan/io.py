"""Read profile files into a Profile: Packrat JSON or a plain CSV.

JSON: what `packrat profile` writes, read by packrat.profile.store (the format's
    one owner; see its docstring). The planner does not check the fingerprint:
    planning from a foreign profile (such as the paper's) is a what-if question;
    refusing a mismatched profile is for the code that applies a plan.
CSV: a header with at least threads,batch,latency_ms (milliseconds, the mean);
    other columns are ignored, e.g. the paper's latency_min_ms/latency_max_ms.

Every problem is a ProfileError naming the file (and line or point), so the CLI
can print one line.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from packrat.errors import ProfileError
from packrat.profile import store
from packrat.types import Profile, ProfilePoint

__all__ = ["load_profile"]

_CSV_COLUMNS = ("threads", "batch", "latency_ms")


def load_profile(path: str | Path) -> Profile:
    """Load a profile from `path`; `.csv` files are CSV, anything else JSON."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file")
    if path.suffix.lower() != ".csv":
        return store.load_profile(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read: {exc}") from exc
    return _from_csv(text, path)


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

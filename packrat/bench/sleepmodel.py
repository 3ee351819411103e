"""The sleep model (tests/data/observe/sleepmodel): a model directory whose worker sleeps a
table latency per batch and claims its slot, for swap and reliability runs without torch work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SLEEP_MODEL = Path(__file__).resolve().parents[2] / "tests" / "data" / "observe" / "sleepmodel"


def copy_sleep_model(store: Path, name: str) -> Path:
    """The sleep model (sleeps a table latency per batch, claims its slot) as `name` in `store`."""
    base = store / name
    shutil.copytree(SLEEP_MODEL, base, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = json.loads((base / "MAR-INF" / "MANIFEST.json").read_text())
    manifest["model"]["modelName"] = name
    (base / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(manifest))
    return base

"""swaps.jsonl: one line per swap attempt (durations, outcome, error), appended with fsync."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

HISTORY_FILE = "swaps.jsonl"

log = logging.getLogger("packrat.controller")


class History:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / HISTORY_FILE

    def read(self, model: str | None = None, last: int = 20) -> list[dict[str, Any]]:
        """The last `last` records, of `model` or of every model, oldest first."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if model is None or rec.get("model") == model:
                out.append(rec)
        return out[-last:]

    def append(self, rec: dict[str, Any]) -> None:
        # Append + fsync per line: a crash loses at most the line being written.
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append_quietly(self, rec: dict[str, Any]) -> None:
        """append(), a full disk logged rather than raised (the swap itself is done)."""
        try:
            self.append(rec)
        except OSError:
            log.exception("could not append to %s", self.path)

"""swaps.jsonl: one line per swap attempt (durations, outcome, error), appended with fsync.

The status page asks for a model's last swaps every few seconds per tab, so the file is
not parsed whole per call: History keeps the last KEEP_LINES records in memory and on
each read parses only the bytes appended since (a stat when nothing was). The first read
starts at most TAIL_BYTES before the end. At ROTATE_BYTES the file moves to
swaps.jsonl.1 (one generation kept): it no longer grows for as long as the controller
runs, and a new History (a restarted controller) reads the tail of both.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

HISTORY_FILE = "swaps.jsonl"
KEEP_LINES = 2000  # records held in memory: what read() can return
TAIL_BYTES = 4 << 20  # where a first read starts, at most, before the end
ROTATE_BYTES = 16 << 20  # swaps.jsonl moves to swaps.jsonl.1 beyond this

log = logging.getLogger("packrat.controller")


class History:
    def __init__(self, state_dir: Path, rotate_bytes: int = ROTATE_BYTES) -> None:
        self.path = Path(state_dir) / HISTORY_FILE
        self.rotated = self.path.with_name(HISTORY_FILE + ".1")
        self.rotate_bytes = rotate_bytes
        self._lock = threading.Lock()
        self._tail: deque[dict[str, Any]] = deque(maxlen=KEEP_LINES)
        self._file: tuple[int, int] | None = None  # (device, inode) of the file parsed so far
        self._offset = 0  # bytes of it parsed (whole lines only)
        self.lines_parsed = 0  # how many lines were parsed, ever (tests: reads stay on the tail)

    def read(self, model: str | None = None, last: int = 20) -> list[dict[str, Any]]:
        """The last `last` records (of the last KEEP_LINES), of `model` or of every model, oldest first."""
        with self._lock:
            self._catch_up()
            out = [r for r in self._tail if model is None or r.get("model") == model]
        return out[-last:]

    def _catch_up(self) -> None:  # with self._lock held
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._tail.clear()
            self._file, self._offset = None, 0
            return
        ident = (st.st_dev, st.st_ino)
        if ident != self._file or st.st_size < self._offset:  # new, rotated or replaced: from its tail
            self._tail.clear()
            self._file = ident
            self._offset = max(0, st.st_size - TAIL_BYTES)
            room = TAIL_BYTES - st.st_size
            if room > 0 and self.rotated.exists():
                self._parse(self.rotated, max(0, self.rotated.stat().st_size - room), None)
        if st.st_size > self._offset:
            self._offset = self._parse(self.path, self._offset, st.st_size)

    def _parse(self, path: Path, start: int, end: int | None) -> int:
        """Parse the whole lines of `path` from `start` (a line start, else the next one) to `end`;
        returns where the last whole line ended."""
        with open(path, "rb") as f:
            if start > 0:
                f.seek(start - 1)
                if f.read(1) != b"\n":  # mid-line: that line's head is not ours to read
                    start += len(f.readline())
            f.seek(start)
            data = f.read() if end is None else f.read(max(0, end - start))
        whole = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        for line in data[:whole].splitlines():
            self.lines_parsed += 1
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if isinstance(rec, dict):
                self._tail.append(rec)
        return start + whole

    def append(self, rec: dict[str, Any]) -> None:
        # Append + fsync per line: a crash loses at most the line being written.
        with self._lock:
            self._rotate_if_large()
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def _rotate_if_large(self) -> None:  # with self._lock held
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self.rotate_bytes:
            return
        self._catch_up()  # every line is in memory before the file moves
        os.replace(self.path, self.rotated)
        self.path.touch()
        st = os.stat(self.path)
        self._file, self._offset = (st.st_dev, st.st_ino), 0  # the tail in memory goes on here

    def append_quietly(self, rec: dict[str, Any]) -> None:
        """append(), a full disk logged rather than raised (the swap itself is done)."""
        try:
            self.append(rec)
        except OSError:
            log.exception("could not append to %s", self.path)

"""A worker's batch counters, in a small memory-mapped file beside its status file.

The drain (packrat/apply/swap.py) needs to know, per worker, how many batches it has
started and finished. The worker used to rewrite its JSON status file for that, twice
per batch: open, write, rename cost ~0.2 ms each on ext4 (0.44 ms of every batch, and
~65 % of a no-op request's time in the worker; docs/live-plans.md, "TorchServe's own
cost"). Here the worker maps `<pid>.live` once and updates it in place: a few
stores, no system call.

Layout: five native 64-bit words: sequence, started, done, busy, time (microseconds
since the epoch). The writer makes the sequence odd while it writes and even when
done (a seqlock), one aligned word store each (a memoryview, not struct.pack_into,
which zeroes the whole span first); a reader takes a record only when two reads agree
and the sequence is even, so it never sees half an update.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import time
from pathlib import Path

RECORD = struct.Struct("=5Q")  # sequence, started, done, busy (0/1), time (µs since the epoch)
_READ_ATTEMPTS = 1000


class LiveCounters:
    """The writing side: one per worker process, created once."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, RECORD.size)
            self._map = mmap.mmap(fd, RECORD.size)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("Q")
        self.store(0, 0, False)

    def store(self, started: int, done: int, busy: bool) -> None:
        words = self._words
        words[0] += 1  # odd: a reader retries
        words[1] = started
        words[2] = done
        words[3] = int(busy)
        words[4] = time.time_ns() // 1000
        words[0] += 1


def read_counters(path: Path) -> dict[str, object] | None:
    """{started, done, busy, time, settled} from a worker's counter file; None if there is
    none or it is not a regular file of this user. A record that kept changing under
    the reader (settled False; an update is five stores, twice per batch) comes back
    busy, so a drain waits for the next look."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.EACCES):
            raise
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        consistent = False
        for _ in range(_READ_ATTEMPTS):
            first = os.pread(fd, RECORD.size, 0)
            if len(first) < RECORD.size:
                return None
            if RECORD.unpack(first)[0] % 2 == 0 and os.pread(fd, RECORD.size, 0) == first:
                consistent = True
                break
        _, started, done, busy, at_us = RECORD.unpack(first)
        return {"started": started, "done": done, "busy": bool(busy) or not consistent,
                "time": at_us / 1e6, "settled": consistent}
    finally:
        os.close(fd)

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

After them, the sizes of what the worker served (issue 32, "traffic-shaped profiles"):
per kind of size (SIZE_KINDS: text tokens, image pixels, generated tokens) BUCKETS
request counts and the sum of the sizes, cumulative since the worker started, written
under the same sequence word. Sizes 0-15 have a bucket each (a short text's tokens are
read exactly: one token is 15-25 % of a 4-7-token batch's cost); from 16 up buckets are
half-octaves (each √2 wide: 16-23, 24-31, 32-47, ...), so a quantile read from them is
within ~20 % of the exact one; 64 of them reach 2 x 10^8 (25-megapixel images
included). Beside the sum, the smallest and the largest size served: a quantile is clamped
to them, so traffic of one size reads exactly at any size (16 new tokens a request
read p90 22.3 from the 16-23 bucket alone). A last word says the layout (LAYOUT): a file
of another layout (a worker started before an upgrade) reads as one without a histogram,
never as wrong sizes. The handler adds a
batch's sizes with add_sizes(): a few stores per request, no system call. A file of
the five words alone (a worker from before the histogram) reads as counters without one.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

RECORD = struct.Struct("=5Q")  # sequence, started, done, busy (0/1), time (µs since the epoch)
SIZE_KINDS = ("tokens", "pixels", "generated")  # text/prompt tokens, image width x height, generated tokens
BUCKETS = 64  # buckets per kind; the last one holds everything from 3 x 2^26 up
EXACT = 16  # sizes below this have a bucket each
LAYOUT = 3  # the histogram's layout: 1 was half-octaves from 4 up, without this word; 2 had no bounds
_KIND_WORDS = BUCKETS + 3  # the counts, the sum of the sizes, the smallest + 1 (0: none yet), the largest
_SIZES_AT = {kind: RECORD.size // 8 + i * _KIND_WORDS for i, kind in enumerate(SIZE_KINDS)}
FULL_RECORD = struct.Struct(f"={5 + len(SIZE_KINDS) * _KIND_WORDS + 1}Q")  # the base record, histograms, LAYOUT
_READ_ATTEMPTS = 1000


def size_bucket(n: int) -> int:
    """The bucket of size n >= 0: 0-15 alone, then two buckets per power of two."""
    if n < EXACT:
        return n
    b = n.bit_length()  # >= 5
    return min(BUCKETS - 1, EXACT + 2 * (b - 5) + ((n >> (b - 2)) & 1))


_SMALL = 4096  # sizes below this find their bucket in a table (token counts always do)
_SMALL_BUCKETS = bytes(size_bucket(n) for n in range(_SMALL))


def bucket_low(k: int) -> int:
    """The smallest size bucket k holds."""
    if k < EXACT:
        return k
    b = (k - EXACT) // 2 + 5
    return (1 << (b - 1)) + ((k - EXACT) & 1) * (1 << (b - 2))


class LiveCounters:
    """The writing side: one per worker process, created once."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, FULL_RECORD.size)
            self._map = mmap.mmap(fd, FULL_RECORD.size)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("Q")
        self._words[FULL_RECORD.size // 8 - 1] = LAYOUT
        self.store(0, 0, False)

    def add_sizes(self, sizes: Mapping[str, Sequence[int]]) -> None:
        """Count one batch's request sizes, {kind: [size >= 0 per request]}; kinds not in
        SIZE_KINDS are ignored. The sequence is made even again whatever a size is, so a
        bad value cannot leave the record "being written" (the drain would wait forever)."""
        words = self._words
        words[0] += 1
        try:
            for kind, values in sizes.items():
                at = _SIZES_AT.get(kind)
                if at is None:
                    continue
                for n in values:  # per request: a table look-up (size_bucket() costs ~3x as much)
                    words[at + (_SMALL_BUCKETS[n] if n < _SMALL else size_bucket(n))] += 1
                if values:
                    words[at + BUCKETS] += sum(values)
                    low, high = min(values), max(values)  # stored only when they widen the bounds
                    was = words[at + BUCKETS + 1]
                    if not was or low < was - 1:
                        words[at + BUCKETS + 1] = low + 1
                    if high > words[at + BUCKETS + 2]:
                        words[at + BUCKETS + 2] = high
        finally:
            words[0] += 1

    def store(self, started: int, done: int, busy: bool) -> None:
        words = self._words
        words[0] += 1  # odd: a reader retries
        words[1] = started
        words[2] = done
        words[3] = int(busy)
        words[4] = time.time_ns() // 1000
        words[0] += 1


def _read_record(path: Path, size: int) -> tuple[bytes, bool] | None:
    """(the first `size` bytes, whether two reads agreed on an even sequence) of a
    worker's counter file; None if there is none, it is shorter, or it is not a regular
    file of this user."""
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
        for _ in range(_READ_ATTEMPTS):
            first = os.pread(fd, size, 0)
            if len(first) < size:
                return None
            if RECORD.unpack_from(first)[0] % 2 == 0 and os.pread(fd, size, 0) == first:
                return first, True
        return first, False
    finally:
        os.close(fd)


def read_counters(path: Path) -> dict[str, object] | None:
    """{started, done, busy, time, settled} from a worker's counter file; None if there is
    none or it is not a regular file of this user. A record that kept changing under
    the reader (settled False; an update is five stores, twice per batch) comes back
    busy, so a drain waits for the next look."""
    got = _read_record(path, RECORD.size)
    if got is None:
        return None
    record, consistent = got
    _, started, done, busy, at_us = RECORD.unpack(record)
    return {"started": started, "done": done, "busy": bool(busy) or not consistent,
            "time": at_us / 1e6, "settled": consistent}


@dataclass(frozen=True)
class SizeHistogram:
    """Request counts per bucket (size_bucket) of one kind of size, the sizes' sum, and
    bounds every counted size lies within (None: not known)."""

    counts: tuple[int, ...] = (0,) * BUCKETS
    total: int = 0
    low: int | None = None
    high: int | None = None

    @property
    def requests(self) -> int:
        return sum(self.counts)

    def __add__(self, other: SizeHistogram) -> SizeHistogram:
        counts = tuple(a + b for a, b in zip(self.counts, other.counts))
        parts = [h for h in (self, other) if h.requests]  # an empty side has no bounds to give
        lows, highs = [h.low for h in parts], [h.high for h in parts]
        if not parts or None in lows or None in highs:  # a part without bounds: the sum has none
            return SizeHistogram(counts, self.total + other.total)
        return SizeHistogram(counts, self.total + other.total, min(lows), max(highs))  # type: ignore[type-var]

    def __sub__(self, other: SizeHistogram) -> SizeHistogram:
        """What was counted since `other`, an earlier reading of the same worker: within
        this reading's bounds (those since the worker started), which hold it too."""
        return SizeHistogram(tuple(a - b for a, b in zip(self.counts, other.counts)), self.total - other.total,
                             self.low, self.high)

    def mean(self) -> float | None:
        n = self.requests
        return self.total / n if n else None

    def quantile(self, q: float) -> float | None:
        """The size below which a fraction q of the requests lie, interpolated linearly
        inside its bucket and clamped to the bounds (exact for sizes 0-15 and for traffic
        of one size; None with no requests)."""
        n = self.requests
        if not n:
            return None
        rank = q * n
        seen = 0
        for k, c in enumerate(self.counts):
            if c and seen + c >= rank:
                low = bucket_low(k)
                high = bucket_low(k + 1) - 1 if k + 1 < BUCKETS else low  # the largest size it holds
                found = low + (high - low) * max(0.0, rank - seen) / c
                if self.low is not None and self.high is not None:
                    # Clamped, not interpolated inside the narrowed range: every size lies within
                    # the bounds, so clamping never moves the estimate away from the true one
                    # (300 requests of 40 tokens after shorter ones: 32-40 would read 36).
                    found = min(max(found, self.low), self.high)
                return found
            seen += c
        return float(bucket_low(BUCKETS - 1))


def read_sizes(path: Path) -> dict[str, SizeHistogram] | None:
    """{kind: SizeHistogram} from a worker's counter file, read whole under the seqlock;
    None if there is none, it is not a regular file of this user, it has no histogram
    or one of another layout (an older worker), or it kept changing under the reader."""
    got = _read_record(path, FULL_RECORD.size)
    if got is None or not got[1]:
        return None
    words = FULL_RECORD.unpack(got[0])
    if words[-1] != LAYOUT:
        return None
    out = {}
    for kind, at in _SIZES_AT.items():
        low_plus_1, high = words[at + BUCKETS + 1], words[at + BUCKETS + 2]
        out[kind] = SizeHistogram(words[at:at + BUCKETS], words[at + BUCKETS],
                                  low_plus_1 - 1 if low_plus_1 else None, high if low_plus_1 else None)
    return out

"""A worker's batch counters: written in place, read whole (never half an update), and
only from a regular file of this user."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from packrat.worker_counters import RECORD, LiveCounters, read_counters


def test_counters_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "1.live"
    assert read_counters(path) is None
    counters = LiveCounters(path)
    assert read_counters(path)["started"] == 0
    counters.store(3, 2, busy=True)
    got = read_counters(path)
    assert (got["started"], got["done"], got["busy"]) == (3, 2, True)
    assert abs(got["time"] - time.time()) < 5
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_record_being_written_reads_busy(tmp_path: Path) -> None:
    path = tmp_path / "1.live"
    now_us = time.time_ns() // 1000
    path.write_bytes(RECORD.pack(7, 4, 4, 0, now_us))  # odd sequence: mid-update
    assert read_counters(path)["busy"] is True
    path.write_bytes(RECORD.pack(8, 4, 4, 0, now_us))
    assert read_counters(path)["busy"] is False


def test_symlinks_and_short_files_are_not_believed(tmp_path: Path) -> None:
    real = tmp_path / "real.live"
    LiveCounters(real).store(1, 1, busy=False)
    link = tmp_path / "2.live"
    link.symlink_to(real)
    assert read_counters(link) is None
    short = tmp_path / "3.live"
    short.write_bytes(b"\0" * 8)
    assert read_counters(short) is None
    if os.getuid() == 0:
        os.chown(real, 65534, 65534)
        assert read_counters(real) is None


def _hammer(path: str, seconds: float, ready) -> None:
    counters = LiveCounters(Path(path))
    ready.set()
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        n += 1
        counters.store(n, n - 1, busy=True)
        counters.store(n, n, busy=False)


def test_reader_never_sees_half_an_update(tmp_path: Path) -> None:
    """A writer in another process stores (n, n-1, busy) and (n, n, idle) as fast as it
    can; every record read is one of those, never a mix."""
    path = tmp_path / "4.live"
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    writer = context.Process(target=_hammer, args=(str(path), 2.0, ready))
    writer.start()
    assert ready.wait(30)
    settled = unsettled = 0
    last_started = 0
    try:
        while writer.is_alive():
            got = read_counters(path)
            assert got is not None
            if not got["settled"]:  # gave up after many tries: reported busy, values not used
                assert got["busy"]
                unsettled += 1
                continue
            assert (got["started"] - got["done"], got["busy"]) in ((1, True), (0, False)), got
            assert got["started"] >= last_started, (got, last_started)
            last_started = got["started"]
            settled += 1
    finally:
        writer.join(10)
    assert settled > 100 and last_started > 100 and unsettled < settled, (settled, unsettled)

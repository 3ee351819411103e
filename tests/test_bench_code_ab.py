"""packrat.bench.code_ab's report (scripts/bench_code_ab.py) on hand-made windows: the medians leave out each
session's first windows (the JVM's JIT), the ratio is B over A, and the front matter names
the machine and the commits (the sessions themselves are a benchmark, not a test)."""

from __future__ import annotations

from packrat.bench.code_ab import render


def _window(session: int, side: str, window: int, rps: float, worker_ms: float) -> dict:
    return {"session": session, "side": side, "commit": side.lower() * 7, "window": window, "items_per_s": rps,
            "p50_ms": 8000 / rps, "worker_ms_per_request": worker_ms, "jvm_ms_per_request": 0.2}


def test_the_report_compares_the_windows_after_the_warm_ones() -> None:
    rows = []
    for session, side in enumerate("ABBA", 1):
        rows.append(_window(session, side, 0, 100.0, 9.0))  # still compiling: left out
        rows += [_window(session, side, w, (400.0 if side == "A" else 500.0) + w, 4.0 if side == "A" else 3.5)
                 for w in (1, 2)]
    meta = {"date": "2026-12-05 12:00-12:10 UTC", "machine": "AMD EPYC, 2 cores", "command": "python x",
            "a": "aaaaaaa", "b": "bbbbbbb", "model": "bert-base", "mode": "int8-onnxruntime", "plan": "2x(t1,b4)",
            "max_length": 8, "warm_s": 45.0, "windows": 3, "window_s": 15.0, "skip": 1, "order": list("ABBA")}
    text = render(rows, meta)
    head = text.split("---")[1]
    assert "machine: AMD EPYC, 2 cores" in head
    assert "B/A served throughput 1.249 (A 401-402, B 501-502 req/s)" in head  # 501.5 / 401.5
    assert "worker CPU a request A 4.0 ms, B 3.5 ms" in head
    assert "| A | aaaaaaa | 4 | 401.5 |" in text and "| B | bbbbbbb | 4 | 501.5 |" in text
    assert text.count("(left out)") == 4

"""Benchmark results on disk: one JSON object per line, appended the moment it is measured.

A run writes to `<out>/results.jsonl`. Each line has a `kind`:

* `run`          what was run: command line, mode, machine, start time;
* `measurement`  one configuration at one load B: model, B, config
                 ("fat" | "defaults" | "packrat" | "oracle" | "fat-tuned" | "tuned"),
                 the shape and execution mode that were live, the optimiser's
                 prediction (if any) and the load generator's summary (`load`:
                 p50/p95/p99, throughput, errors, ...);
* `tune`         the one tune of a model (packrat.bench.tuned): its time, state,
                 every mode's outcome and the choice at the tune's B;
* `capacity`     the load generator measured against a target that does no work;
* `note`         something that went wrong or was skipped (kept, not hidden).

Appending line by line (flushed and fsynced) means an interrupted run keeps
everything it measured; reports only ever read this file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packrat.errors import ConfigError

# fat, packrat and oracle run in the archive's own mode; fat-tuned (1 worker x T threads,
# cap B) and tuned (the tune's (mode, plan) for B) in the mode the tune chose for B.
CONFIGS = ("fat", "defaults", "packrat", "oracle", "fat-tuned", "tuned")


@dataclass(frozen=True)
class Measurement:
    """One `measurement` line, typed."""

    model: str
    batch: int
    config: str
    shape: str  # e.g. "2x(1t,b4)" or "defaults: 2 workers, torch threads, batch 1"
    instances: tuple[tuple[int, int], ...]  # (threads, batch cap) per worker; () when unknown
    predicted_ms: float | None
    load: dict[str, Any]
    run_id: str = ""
    time: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    mode: str | None = None  # execution mode that served it; None: not recorded (older runs)

    @property
    def p50(self) -> float | None:
        return self.load.get("p50_ms")

    @property
    def valid(self) -> bool:
        """Usable as a latency: answered requests and no failed ones."""
        return bool(self.load.get("ok")) and not self.load.get("errors") and self.p50 is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "measurement",
            "run_id": self.run_id,
            "time": self.time,
            "model": self.model,
            "batch": self.batch,
            "config": self.config,
            "shape": self.shape,
            "instances": [list(i) for i in self.instances],
            "predicted_ms": self.predicted_ms,
            "load": self.load,
            "extra": self.extra,
            "mode": self.mode,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Measurement":
        try:
            config = str(d["config"])
            if config not in CONFIGS:
                raise ValueError(f"unknown config {config!r}")
            return Measurement(
                model=str(d["model"]),
                batch=int(d["batch"]),
                config=config,
                shape=str(d.get("shape", "")),
                instances=tuple((int(t), int(b)) for t, b in d.get("instances") or ()),
                predicted_ms=None if d.get("predicted_ms") is None else float(d["predicted_ms"]),
                load=dict(d["load"]),
                run_id=str(d.get("run_id", "")),
                time=float(d.get("time", 0.0)),
                extra=dict(d.get("extra") or {}),
                mode=None if d.get("mode") is None else str(d["mode"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed measurement record: {exc}: {d!r}") from exc


def shape_label(instances: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> str:
    """(threads, cap) pairs -> "2x(1t,b4)" or "1x(2t,b8)+1x(1t,b8)", widest first."""
    from collections import Counter

    counts = Counter(tuple(i) for i in instances)
    parts = [f"{n}x({t}t,b{b})" for (t, b), n in sorted(counts.items(), key=lambda kv: (-kv[0][0], -kv[0][1]))]
    return "+".join(parts)


class ResultLog:
    """Append-only JSONL writer (one line per record, fsynced)."""

    def __init__(self, path: str | Path, run_id: str | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())

    def append(self, kind: str, record: dict[str, Any]) -> dict[str, Any]:
        line = {"kind": kind, "run_id": self.run_id, "time": time.time(), **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return line

    def measurement(self, m: Measurement) -> None:
        d = m.to_json()
        d.pop("kind")
        d["run_id"] = self.run_id
        d["time"] = time.time()
        self.append("measurement", {k: v for k, v in d.items() if k not in ("run_id", "time")})


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Every well-formed line; a torn last line (killed mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_measurements(path: str | Path) -> list[Measurement]:
    return [Measurement.from_json(r) for r in read_records(path) if r.get("kind") == "measurement"]

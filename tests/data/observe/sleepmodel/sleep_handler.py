"""Test handler: claims and pins its Packrat slot like the real handler, then
sleeps the model_config's table latency for each batch. Nothing at import."""

from __future__ import annotations

import time
from typing import Any

_state: dict[str, Any] = {}


def _initialize(context: Any) -> None:
    from packrat.slots import claim_and_pin

    cfg = context.model_yaml_config or {}
    claim = claim_and_pin(cfg)
    table = {int(t): {int(b): float(ms) for b, ms in row.items()}
             for t, row in cfg["packrat"]["sleep_ms"].items()}
    threads = claim.threads if claim is not None else max(table)
    _state.update(row=table[threads])


def handle(data: Any, context: Any) -> Any:
    if "row" not in _state:
        _initialize(context)
    if data is None:
        return None
    n = len(data)
    row = _state["row"]
    batch = min((b for b in row if b >= n), default=max(row))
    time.sleep(row[batch] / 1000.0)
    return [{"batch": n, "slept_ms": row[batch]} for _ in range(n)]

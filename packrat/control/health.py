"""GET /healthz: from what the tick loop last saw, without calling TorchServe (the
kubelet probes often and must get an answer at once)."""

from __future__ import annotations

from typing import Any

# GET /healthz fails when the tick loop has not gone round for this long (ticks may
# wait on TorchServe's 30 s HTTP timeout; the liveness probe adds its own 2 minutes).
HEALTH_STALE_TICKS = 12
HEALTH_STALE_MIN_S = 60.0


def health(tick_age_s: float | None, tick_s: float, reachable: bool, swap_running: bool,
           stale_min_s: float = HEALTH_STALE_MIN_S) -> tuple[bool, dict[str, Any]]:
    """(healthy, body): `tick_age_s` None when the loop never went round."""
    stale_after = max(stale_min_s, HEALTH_STALE_TICKS * tick_s)
    age = None if tick_age_s is None else round(tick_age_s, 3)
    problems = []
    if age is None:
        problems.append("the tick loop is not running")
    elif age > stale_after:
        problems.append(f"the tick loop has not gone round for {age:.0f} s (limit {stale_after:.0f} s): "
                        "its thread is dead or stuck")
    if not reachable:
        problems.append("TorchServe's management API did not answer the last tick")
    return not problems, {"status": "ok" if not problems else "unhealthy", "problems": problems,
                          "tick_age_s": age, "tick_stale_after_s": stale_after,
                          "torchserve_reachable": reachable, "swap_running": swap_running}

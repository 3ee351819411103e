"""The two plan shapes the swap benchmarks alternate between on two cores, batch 4."""

from __future__ import annotations

from packrat.types import Instance, Plan


def thin_and_fat(mode: str | None = None) -> tuple[Plan, Plan]:
    """(thin, fat): 2 x (1 thread, cap 2) and 1 x (2 threads, cap 4), in `mode` (None: the
    base archive's own)."""
    thin = Plan(cores=2, batch=4, instances=(Instance(1, 2, 0.0), Instance(1, 2, 0.0)),
                predicted_latency_ms=0.0, mode=mode)
    fat = Plan(cores=2, batch=4, instances=(Instance(2, 4, 0.0),), predicted_latency_ms=0.0, mode=mode)
    return thin, fat

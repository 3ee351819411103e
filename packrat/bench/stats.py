"""The one percentile every benchmark reports, so swap p99s and bench p99s compare."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100) by linear interpolation, numpy's default method.

    Sorted values x[0..n-1]; the percentile sits at position h = q/100 * (n - 1) and is
    x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]). Example: p99 of
    1..100 is at h = 98.01, so 99 + 0.01 * (100 - 99) = 99.01. None for no values.
    """
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))

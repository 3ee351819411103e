"""Synthetic request inputs shared by the tasks and the accuracy guard.

A module of its own so that guard.py can build image inputs without importing
image.py, which imports runtime.py, which imports guard.py: it imports neither.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def sample_jpeg(width: int = 320, height: int = 240, seed: int = 0) -> bytes:
    """A deterministic photo-like JPEG: smooth gradients plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()

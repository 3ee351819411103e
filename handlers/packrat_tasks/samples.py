"""Synthetic request inputs shared by the tasks, the accuracy guard and int8s calibration.

A module of its own, importing no other task module, so that guard.py and
quantize_static.py can build inputs without importing the tasks (image.py,
text.py), which import runtime.py, which imports them. numpy and PIL are
imported by sample_jpeg: a text worker never needs them for its samples.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SAMPLE_SENTENCE = (
    "The quick brown fox jumps over the lazy dog while the servers in the data centre "
    "answer thousands of requests about weather, travel, music and the price of coffee. "
)


def sample_jpeg(width: int = 320, height: int = 240, seed: int = 0) -> bytes:
    """A deterministic photo-like JPEG: smooth gradients plus noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def sample_text(tokenizer: PreTrainedTokenizerBase, n_tokens: int) -> str:
    """A plain English text that tokenises to at most n_tokens (special tokens included)."""
    words = (SAMPLE_SENTENCE * (n_tokens // 8 + 2)).split()
    lo, hi = 1, len(words)
    while lo < hi:  # longest prefix that fits
        mid = (lo + hi + 1) // 2
        if len(tokenizer(" ".join(words[:mid])).input_ids) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])

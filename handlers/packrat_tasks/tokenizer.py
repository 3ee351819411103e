"""The text tasks' tokenizer, without importing transformers when the archive allows it.

transformers' fast tokenizers run the `tokenizers` library on the model directory's
tokenizer.json; importing transformers and wrapping it costs a worker ~0.75 s of CPU
at start (2-core EPYC), which is most of the start of a worker that serves an ONNX
Runtime or OpenVINO mode from the build cache. `FastTokenizer` loads that file
directly and offers what the text tasks use of transformers' API: `tokenizer(text)
.input_ids` (special tokens added, no padding, no truncation) and the ids of the CLS
and PAD tokens named in tokenizer_config.json / special_tokens_map.json. A directory
without tokenizer.json (a slow, Python tokenizer) loads with transformers as before.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Encoding:
    input_ids: list[int]


def _special_token(path: str, name: str) -> str | None:
    """The content of special token `name` ("pad_token", ...) as transformers reads it."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(path, file)) as f:
                value = json.load(f).get(name)
        except (OSError, ValueError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


class FastTokenizer:
    """tokenizers.Tokenizer from tokenizer.json with transformers' defaults for one text."""

    def __init__(self, path: str) -> None:
        import tokenizers

        self._tokenizer = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        # The saved file may carry padding/truncation settings; transformers turns them
        # off unless asked, and so do we (a text longer than max_length is refused, never cut).
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self.cls_token_id = self._id(_special_token(path, "cls_token"))
        self.pad_token_id = self._id(_special_token(path, "pad_token"))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


def load_tokenizer(path: str) -> Any:
    """FastTokenizer when `path` has a tokenizer.json, else transformers' AutoTokenizer."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return FastTokenizer(path)
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


__all__ = ["Encoding", "FastTokenizer", "load_tokenizer"]

"""The handler's JSON responses (packrat_tasks.base.encode_json): what TorchServe is handed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from packrat_tasks import base  # handlers/: on the path (pyproject's pythonpath)
from packrat_tasks.base import ErrorResponse, RequestError, encode_json


def test_an_embedding_encodes_compact_and_reads_back_to_the_same_floats() -> None:
    row = torch.nn.functional.normalize(torch.randn(384, generator=torch.Generator().manual_seed(0)), dim=0)
    response = {"embedding": row.tolist()}
    encoded = encode_json(response)
    assert isinstance(encoded, bytes) and b" " not in encoded and b"\n" not in encoded
    assert json.loads(encoded) == response  # every float exactly (shortest round-trip reprs)


def test_what_orjson_refuses_goes_through_json_and_what_neither_encodes_is_left() -> None:
    assert base.orjson is not None  # pinned in pyproject.toml: the fast path is the one that serves
    assert json.loads(encode_json({1: "a"})) == {"1": "a"}  # int keys: orjson refuses, json writes them
    assert json.loads(encode_json({"n": 2**70})) == {"n": 2**70}
    odd = {"x": object()}
    assert encode_json(odd) is odd  # TorchServe answers this one 503, as before
    assert json.loads(encode_json({"v": [math.nan, 1.5]})) == {"v": [None, 1.5]}  # NaN is not JSON


@pytest.mark.parametrize("given", [b"raw bytes", bytearray(b"ba"), "a str"])
def test_bytes_and_str_stay_as_the_task_made_them(given) -> None:
    assert encode_json(given) is given


def test_an_error_response_is_json_with_its_fields() -> None:
    encoded = encode_json(ErrorResponse(RequestError(413, "text too long")))
    assert json.loads(encoded) == {"code": 413, "type": "BadInput", "message": "text too long"}

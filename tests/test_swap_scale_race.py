"""retire()'s scale to 0 when TorchServe 0.12 answers it with a 5xx.

TorchServe may fail a scale-down that races a batch in flight (HTTP 500 "Cannot invoke
Job.isControlCmd() because job is null"; seen in tests/test_reliability_faults.py). That
race cannot be produced on demand, so the client here only answers scale() with the error;
retire()'s rounds against a real TorchServe are in tests/test_apply_swap.py.
"""

from __future__ import annotations

import logging

import pytest

from packrat.apply.swap import Swapper
from packrat.errors import TorchServeError


class _ScaleFails:
    def __init__(self, status: int) -> None:
        self.status = status
        self.calls: list[tuple] = []

    def scale(self, *args, **kwargs) -> None:
        self.calls.append(args)
        raise TorchServeError("PUT", "http://127.0.0.1:8081/models/m/p2", self.status,
                              'Cannot invoke "org.pytorch.serve.job.Job.isControlCmd()" because "job" is null')


def test_a_5xx_is_left_to_the_next_round(tmp_path, caplog) -> None:
    client = _ScaleFails(500)
    with caplog.at_level(logging.WARNING, logger="packrat.apply.swap"):
        Swapper(client, tmp_path, cores=[0])._scale_to_zero("m", "p2", 1.0)
    assert client.calls == [("m", "p2", 0)]
    assert "retrying in the next round" in caplog.text and "HTTP 500" in caplog.text


def test_a_4xx_still_fails_the_retire(tmp_path) -> None:
    with pytest.raises(TorchServeError) as exc:
        Swapper(_ScaleFails(404), tmp_path, cores=[0])._scale_to_zero("m", "p2", 1.0)
    assert exc.value.status == 404

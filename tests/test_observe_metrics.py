"""Parsing TorchServe 0.12's Prometheus text (a real scrape of two versions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from packrat.observe.metrics import observation, observations, parse_counters, pending_from_describe

DATA = Path(__file__).parent / "data" / "observe"
# Scraped from TorchServe 0.12.0 with versions 1.0 and 2.0 of "tiny" loaded,
# after 3 requests to /predictions/tiny, 1 to .../tiny/1.0 and 1 to .../tiny/2.0.
TWO_VERSIONS = (DATA / "two_versions.prom").read_text()


def test_labels_are_the_requested_version() -> None:
    # TorchServe labels by the version in the URL ("default" when none), not
    # by the version that served: the reason observe sums over versions.
    versions = {(c.family, c.version): c.value for c in parse_counters(TWO_VERSIONS)}
    assert versions[("ts_inference_requests", "default")] == 3.0
    assert versions[("ts_inference_requests", "1.0")] == 1.0
    assert versions[("ts_inference_requests", "2.0")] == 1.0
    # host gauges (MemoryUsed, CPUUtilization, ...) are not picked up
    assert {c.family for c in parse_counters(TWO_VERSIONS)} == {
        "ts_inference_requests", "ts_inference_latency_microseconds",
        "ts_queue_latency_microseconds"}


def test_versions_are_summed() -> None:
    o = observation(TWO_VERSIONS, "tiny", 12.5)
    assert o.time_s == 12.5 and o.model == "tiny"
    assert o.requests_total == 3.0 + 1.0 + 1.0
    assert o.latency_us_total == pytest.approx(168970.651 + 54086.69 + 54637.987)
    assert o.queue_latency_us_total == pytest.approx(935.014 + 179.125 + 103.439)


def test_excluded_version_is_left_out() -> None:
    o = observation(TWO_VERSIONS, "tiny", 0.0, exclude_versions=["2.0"])
    assert o.requests_total == 3.0 + 1.0
    assert o.latency_us_total == pytest.approx(168970.651 + 54086.69)


def test_model_without_traffic_reads_zero() -> None:
    # Series appear on a model's first request; absent means nothing served yet.
    o = observation(TWO_VERSIONS, "other", 1.0, pending_requests=0)
    assert (o.requests_total, o.latency_us_total, o.pending_requests) == (0.0, 0.0, 0)
    assert set(observations(TWO_VERSIONS, 1.0)) == {"tiny"}


def test_counter_without_type_line_and_with_total_suffix() -> None:
    # Tolerate exporters/filters that drop the # TYPE lines (family = sample name).
    text = ('ts_inference_requests_total{model_name="m",model_version="default",hostname="h",} 7.0\n'
            'ts_inference_latency_microseconds{model_name="m",model_version="default",hostname="h",} 70.0\n')
    o = observation(text, "m", 0.0)
    assert (o.requests_total, o.latency_us_total, o.queue_latency_us_total) == (7.0, 70.0, None)


def test_pending_from_describe_sums_versions() -> None:
    describe = [{"modelVersion": "1.0", "jobQueueStatus": {"remainingCapacity": 97, "pendingRequests": 3}},
                {"modelVersion": "2.0", "jobQueueStatus": {"remainingCapacity": 99, "pendingRequests": 1}},
                {"modelVersion": "3.0"}]
    assert pending_from_describe(describe) == 3 + 1 + 0

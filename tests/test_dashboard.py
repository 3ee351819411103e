"""docs/grafana/packrat.json names only metrics a live TorchServe and controller export.

A real TorchServe (config.properties: metrics_mode=prometheus) serves the noop
archive; a `packrat controller` with the re-plan loop on has made decisions and
has run a swap (an explicit plan over REST). Both metrics endpoints are scraped
as Prometheus would; every PromQL expression of the dashboard (panels,
annotations) is parsed (promql-parser, after Grafana's variables are given
values), and each metric it selects must have samples in one of the scrapes,
with every label its matchers use.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from serving_support import noop_with_controller

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "packrat.json"
MODEL = "dash-echo"
# Grafana's variables as a query would get them.
VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$model": ".*"}
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')


def expressions(node: Any) -> list[str]:
    """Every `expr` in the dashboard: panel targets and annotations."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in expressions(v)]
    return []


def exported(text: str) -> dict[str, set[str]]:
    """Sample names (as Prometheus stores them: no _total added) -> the label names they carry."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and not line.startswith("#"):
            out.setdefault(m.group(1), set()).update(LABEL.findall(m.group(2) or ""))
    return out


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names its matchers use) of every vector selector in `expr`."""
    import promql_parser

    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    found: list[tuple[str, set[str]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            names = {m.name for m in node.matchers.matchers}
            names |= {m.name for group in node.matchers.or_matchers for m in group}
            found.append((node.name, names - {"__name__"}))

    promql_parser.walk(promql_parser.parse(expr), visit)  # ValueError on a malformed query
    return found


def test_selectors_are_read_from_the_query() -> None:
    got = selectors('sum by (phase) (rate(a_bucket{model=~"$model"}[$__rate_interval])) / b')
    assert got == [("a_bucket", {"model"}), ("b", set())]
    with pytest.raises(ValueError):
        selectors("sum by (model (rate(a[5m]))")


@pytest.fixture(scope="module")
def scrapes(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    # The re-plan loop on (decisions), no swap of its own here (--min-dwell), no tuning.
    with noop_with_controller(tiny_store, tmp_path_factory.mktemp("dash"), MODEL,
                              ["--no-tune", "--min-dwell", "3600"]) as (server, ctl):
        r = requests.post(f"{ctl.url}/v1/models/{MODEL}/apply", json={"instances": [{"threads": 1, "batch": 2}] * 2},
                          headers=ctl.headers(), timeout=300)
        assert r.status_code == 200, r.text
        # Load for a few ticks, so the loop's estimate gets ready (estimated batch, concurrency).
        deadline = time.monotonic() + 60
        while True:
            for i in range(4):
                requests.post(f"{server.inference_url}/predictions/{MODEL}", data=f"dash {i}".encode(),
                              headers=server.inference_headers(), timeout=60).raise_for_status()
            ctl_text = requests.get(f"{ctl.url}/metrics", timeout=10).text
            if "packrat_estimated_batch{" in ctl_text and "packrat_adapt_decisions_total{" in ctl_text:
                break
            assert time.monotonic() < deadline, ctl_text  # a hang guard
            time.sleep(0.5)
        ts_text = requests.get(f"{server.metrics_url}/metrics", timeout=10).text
        yield exported(ts_text), exported(ctl_text)


def test_every_dashboard_query_names_an_exported_metric(scrapes) -> None:
    torchserve, controller = scrapes
    # The scrapes hold what the dashboard is about: a swap with its phases, decisions.
    assert "ts_inference_latency_microseconds" in torchserve and "ts_queue_latency_microseconds" in torchserve
    assert {"packrat_swaps_total", "packrat_swap_phase_seconds_count", "packrat_adapt_decisions_total",
            "packrat_live_plan_info"} <= set(controller)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 15
    missing = []
    for expr in exprs:
        for name, labels in selectors(expr):
            have = torchserve.get(name, set()) | controller.get(name, set())
            if name not in torchserve and name not in controller:
                missing.append(f"{name} (in {expr})")
            elif not labels <= have:
                missing.append(f"{name} has no label {sorted(labels - have)} (in {expr})")
    assert missing == []


def test_template_variables_and_datasources(scrapes) -> None:
    torchserve, _ = scrapes
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    m = re.fullmatch(r"label_values\((\w+), (\w+)\)", variables["model"]["definition"])
    assert m and m.group(2) in torchserve[m.group(1)]
    # Every panel reads the dashboard's Prometheus variable: no data source uid of one Grafana.
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]

"""docs/openapi.json is FastAPI's spec of the current routes (re-export with scripts/export_openapi.py)."""

from __future__ import annotations

import json
from pathlib import Path

from packrat.api import export_openapi

DOC = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"


def test_committed_spec_matches_the_routes(tmp_path: Path) -> None:
    export_openapi(tmp_path / "openapi.json")
    fresh = json.loads((tmp_path / "openapi.json").read_text())
    assert json.loads(DOC.read_text()) == fresh, "run scripts/export_openapi.py"
    # Every operation documents the bearer token, except the Prometheus scrape endpoint
    # and the liveness probe's (both open on purpose, docs/live-plans.md).
    for path, ops in fresh["paths"].items():
        for method, op in ops.items():
            if path not in ("/metrics", "/healthz"):
                assert op.get("security") == [{"HTTPBearer": []}], (method, path)
            else:
                assert "security" not in op, (method, path)

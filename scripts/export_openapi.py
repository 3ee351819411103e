#!/usr/bin/env python
"""Write the controller REST API's OpenAPI spec (FastAPI's own) to docs/openapi.json.

    .venv/bin/python scripts/export_openapi.py [path]

No TorchServe needed: the spec comes from the routes, not from a live controller.
tests/test_controller_openapi.py checks the committed file is up to date.
"""

from __future__ import annotations

import sys
from pathlib import Path

from packrat.api import export_openapi

if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "docs" / "openapi.json"
    export_openapi(out)
    print(f"wrote {out}")

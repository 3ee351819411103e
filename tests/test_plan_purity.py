"""packrat.plan stays pure: no torch, no HTTP clients, and its public names are declared."""

from __future__ import annotations

import subprocess
import sys
import types

import packrat.plan


def test_plan_imports_no_torch_or_http():
    # A fresh interpreter: this test process may already have torch loaded.
    code = ("import sys, packrat.plan, packrat.plan.plot; "
            "bad = [m for m in ('torch', 'requests', 'urllib3', 'httpx', 'packrat.apply') "
            "if m in sys.modules]; print(','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ""


def test_public_names_are_declared():
    public = {n for n in vars(packrat.plan) if not n.startswith("_")}
    # Submodules appear as attributes once anything imported them (order-dependent): not names.
    submodules = {n for n, v in vars(packrat.plan).items() if isinstance(v, types.ModuleType)}
    submodules.add("annotations")  # `from __future__ import annotations`
    assert set(packrat.plan.__all__) == public - submodules

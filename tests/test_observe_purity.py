"""packrat.observe stays on its side of the imports: no torch, no HTTP client,
no apply/control (the controller calls observe, never the other way), and its
public names are declared."""

from __future__ import annotations

import subprocess
import sys
import types

import packrat.observe


def test_observe_imports_no_torch_http_or_controller():
    # A fresh interpreter: this test process may already have them loaded.
    code = ("import sys, packrat.observe, packrat.observe.loop; "
            "bad = [m for m in ('torch', 'requests', 'urllib3', 'httpx', 'packrat.apply', "
            "'packrat.control', 'packrat.api') if m in sys.modules]; print(','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ""


def test_public_names_are_declared():
    # submodules become attributes once anything imports them: not public names
    public = {n for n, v in vars(packrat.observe).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert set(packrat.observe.__all__) == public - {"annotations"}

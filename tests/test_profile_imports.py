"""packrat.profile must not start any thread pool at import: the worker imports it before pinning."""

from __future__ import annotations

import subprocess
import sys

import packrat.profile


def test_public_names_exist():
    for name in packrat.profile.__all__:
        assert hasattr(packrat.profile, name), name


def test_importing_the_package_and_worker_loads_no_numeric_library():
    code = (
        "import sys, packrat.profile, packrat.profile.worker\n"
        "print(sorted(m for m in ('torch', 'numpy', 'scipy', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""The profile -> plan -> apply -> observe -> control loop keeps its import direction.

Every import of a packrat module, at module level or inside a function, is read
from the source (ast), so a lazy import cannot hide an arrow that runs back up.
Each top-level unit has a floor; a unit may import only units on lower floors.
A new module must be given a floor here: that is the moment to decide where it
stands.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FLOORS: dict[str, int] = {
    "packrat.types": 0,  # frozen values that cross stage boundaries
    "packrat.settings": 0,  # the settings table: every PACKRAT_* variable, shared CLI defaults (stdlib only; tslog reads it)
    "packrat.worker_messages": 0,  # the frontend's messages as a worker reads them (stdlib only; slots reads, tslog names its line)
    "packrat.listener": 0,  # who listens on a loopback port (/proc/net/tcp): the key goes to our own user only
    "packrat.backoff": 0,  # how long before a crashed helper starts again (the fork server, the controller)
    "packrat.errors": 1,  # the one exception tree (SwapError carries a types.SwapRecord)
    "packrat.cpulist": 1,  # the kernel's CPU list format (slots and cores read it)
    "packrat.modes": 1,  # execution modes: precisions, runtimes, the mode string, what a CPU runs (stdlib only)
    "packrat.worker_counters": 1,  # a worker's batch counters, a mapped file (slots writes, apply reads via slots)
    "packrat.tslog": 1,  # which log4j2 file TorchServe's frontend starts with (server, forkserver)
    "packrat.slots": 2,  # worker side: runs inside TorchServe's worker and the profiler's
    "packrat.archive": 2,  # building model archives
    "packrat.forkserver": 2,  # processes forked from a warm interpreter (TorchServe's workers, the profiler's)
    "packrat.jobs": 2,  # background jobs for the controller
    "packrat.profile": 3,  # stage 1: isolated timing runs, profile files
    "packrat.plan": 3,  # stage 2: the optimiser, pure
    "packrat.cores": 2,  # usable cores: affinity, cgroup cpuset and quota (read by profile and control)
    "packrat.apply": 4,  # stage 3: the only code that talks to TorchServe's REST API
    "packrat.observe": 4,  # stage 4: counters -> estimated B -> re-plan decision
    "packrat.tune": 4,  # guard + profile each execution mode, choose (mode, plan): profile + plan, no TorchServe
    "packrat.server": 5,  # starting/stopping a TorchServe process (CLI, bench, tests)
    "packrat.control": 5,  # the controller: state, clock, the loop
    "packrat.api": 6,  # REST: parse -> call the controller -> render
    "packrat.bench": 7,
    "packrat.commands": 8,
    "packrat.cli": 9,
}
# What TorchServe's Python worker may import from packrat: the worker side only (its slot,
# and which of TorchServe's log lines it writes); both load no torch and no HTTP (below).
HANDLER_MAY_IMPORT = {"packrat.slots", "packrat.tslog", "packrat.settings", "packrat.modes"}


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _packrat_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "packrat":  # from packrat import slots
                out.update(f"packrat.{a.name}" for a in node.names)
            elif node.module.startswith("packrat."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("packrat."))
    return {_unit(m) for m in out}


def _module_unit(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return _unit(".".join(p for p in parts if p != "__init__"))


def _arrows() -> list[tuple[str, str, Path]]:
    arrows = []
    for path in sorted((ROOT / "packrat").rglob("*.py")):
        me = _module_unit(path)
        arrows += [(me, dep, path) for dep in _packrat_imports(path) if dep != me]
    return arrows


def test_every_unit_has_a_floor() -> None:
    units = {_module_unit(p) for p in (ROOT / "packrat").rglob("*.py")} - {"packrat"}
    assert units - set(FLOORS) == set(), "give the new module a floor in FLOORS"
    assert set(FLOORS) - units == set(), "a unit in FLOORS no longer exists"


def test_imports_point_down() -> None:
    up = [f"{path.relative_to(ROOT)}: {me} (floor {FLOORS[me]}) imports {dep} (floor {FLOORS[dep]})"
          for me, dep, path in _arrows() if FLOORS[dep] >= FLOORS[me]]
    assert up == []


def test_the_checker_sees_an_arrow_that_runs_back_up(tmp_path: Path) -> None:
    # A lazy import inside a function counts too.
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from packrat.control import Controller\n    import packrat.api.x\n"
                   "from packrat import slots\n")
    assert _packrat_imports(bad) == {"packrat.control", "packrat.api", "packrat.slots"}


def test_handlers_import_only_the_worker_side() -> None:
    found = {str(p.relative_to(ROOT)): _packrat_imports(p) - HANDLER_MAY_IMPORT
             for p in sorted((ROOT / "handlers").rglob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


@pytest.mark.parametrize("module", ["packrat.plan", "packrat.profile", "packrat.slots", "packrat.tslog",
                                    "packrat.settings", "packrat.modes"])
def test_pure_stages_load_no_torch_and_no_http(module: str) -> None:
    # A fresh interpreter: this test process may already have torch loaded. The profile
    # stage and the slots are imported by workers before they pin themselves, so the
    # pools torch and numpy start must not be started by importing them.
    code = (f"import sys, {module}; "
            "bad = [m for m in ('torch', 'requests', 'urllib3', 'httpx', 'fastapi', 'packrat.apply', "
            "'packrat.control', 'packrat.observe') if m in sys.modules]; print(','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ""


MAX_FUNCTION_LINES = 80  # a function longer than a screen and a half does more than one thing


def test_no_function_is_longer_than_80_lines() -> None:
    long = []
    for root in ("packrat", "handlers"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_controller_coordinator_and_the_routes_stay_thin() -> None:
    # The coordinator delegates to one module per job; the routes parse, call and render.
    coordinator = (ROOT / "packrat/control/__init__.py").read_text().count("\n")
    routes = (ROOT / "packrat/api/routes.py").read_text().count("\n")
    assert coordinator <= 300 and routes <= 260, (coordinator, routes)

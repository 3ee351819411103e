"""The worker code (handlers/) imports in one direction: no circle, lazy imports included.

Every import of a handler module, at module level, inside a function or under
TYPE_CHECKING, is read from the source (ast), so a function-local import cannot
hide a circle (runtime <-> quantize_static <-> text <-> generation once did).
The runtime registry names exactly packrat.modes' runtimes, and an archive
carries the whole task package, subpackages included.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from packrat import modes
from packrat.archive import build_noop, handler_is_current
from packrat.archive.builder import HANDLER_DIR, TASKS_PACKAGE

sys.path.insert(0, str(HANDLER_DIR))

OURS = (TASKS_PACKAGE, "packrat_handler")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _is_package(name: str, modules: set[str]) -> bool:
    return any(m.startswith(name + ".") for m in modules)


def _targets(node: ast.AST, me: str, modules: set[str]) -> set[str]:
    """The handler modules one import statement names (a submodule when it is one)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] in OURS}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = me if _is_package(me, modules) else me.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}".strip(".")
    if base.split(".")[0] not in OURS:
        return set()
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    modules = {_module_name(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        me = _module_name(path, root)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found |= _targets(node, me, modules)
        graph[me] = {m for m in found if m in modules and m != me}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_handler_package_has_no_import_circle() -> None:
    graph = import_graph(HANDLER_DIR)
    assert "packrat_tasks.runtimes.eager" in graph and graph["packrat_tasks.text"]
    assert circles(graph) == []


def test_the_checker_sees_a_circle_through_a_function_local_import(tmp_path: Path) -> None:
    package = tmp_path / TASKS_PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from packrat_tasks.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("import packrat_tasks.a\n")
    graph = import_graph(tmp_path)
    assert graph["packrat_tasks.sub.b"] == {"packrat_tasks.c"}
    assert circles(graph) == [["packrat_tasks.a", "packrat_tasks.c", "packrat_tasks.sub.b"]]


def test_the_registry_names_the_modes_runtimes() -> None:
    from packrat_tasks import precision, runtime

    assert tuple(runtime.RUNTIMES) == modes.RUNTIMES
    assert precision.PRECISIONS == modes.PRECISIONS


def test_an_archive_carries_the_runtimes_subpackage(tmp_path: Path) -> None:
    archive = build_noop(tmp_path)
    for name in modes.RUNTIMES:
        copied = archive / TASKS_PACKAGE / "runtimes" / f"{name}.py"
        assert copied.read_bytes() == (HANDLER_DIR / TASKS_PACKAGE / "runtimes" / f"{name}.py").read_bytes()
    assert handler_is_current(archive)
    (archive / TASKS_PACKAGE / "runtimes" / "eager.py").write_text("# changed\n")
    assert not handler_is_current(archive)

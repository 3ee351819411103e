"""What README.md and docs/*.md cite exists, so the docs cannot rot as the code moves.

Three kinds of reference are read from the prose (fenced code blocks included:
a command that names a script is a citation too):
- a backticked repo path (`packrat/cores.py`, `scripts/bench.py --full`,
  `tests/test_x.py::test_y`): the file or folder must exist;
- a backticked dotted name (`packrat.control.tuning`, `packrat.plan.knapsack.solve`):
  the module must exist, and a name after it must be defined at its top level; a
  `packrat.<key>` that is no module is a model_config.yaml key or a logger name, and
  must be a string in packrat/ or handlers/ (`"task"`, `getLogger("packrat.adapt")`);
- a markdown link to a local file ([x](docs/y.md#z)): the file must exist, and an
  anchor into a markdown file must be one of its headings (GitHub's slugs).
Placeholders and globs (`<model>`, `*.mar`, `{name}`, `...`) are skipped: they name no one file.
docs/benchmarks/ holds dated results files, written once; they are not swept.
"""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("packrat/", "handlers/", "scripts/", "tests/", "docs/", "deploy/", "plugin/")
PLACEHOLDER = re.compile(r"[<>*?{}$]|\.\.\.")
BACKTICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^packrat(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
# [text](target "title"): the target up to a space or the closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _path_tokens(span: str) -> list[str]:
    out = []
    for token in span.split():
        token = token.strip("'\",;()[]")
        token = re.sub(r"^[A-Z_]+=", "", token)  # VAR=scripts/y.py
        if token.startswith(PREFIXES) and not PLACEHOLDER.search(token):
            out.append(re.split(r"::|:\d", token)[0].rstrip(".:"))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def _anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _without_fences(doc.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _module_file(base: Path) -> Path | None:
    module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return module if module.is_file() else None


@cache
def _top_level_names(module_file: Path) -> set[str]:
    names = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@cache
def _source_strings() -> frozenset[str]:
    strings = set()
    for path in [*(ROOT / "packrat").rglob("*.py"), *(ROOT / "handlers").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return frozenset(strings)


def _key_or_logger(name: str) -> bool:
    key = name.split(".", 1)[1]
    word = re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")
    return key in _source_strings() or any(word.search(s) for s in _source_strings())


def _dotted_exists(name: str) -> bool:
    parts = name.split(".")
    if len(parts) == 2 and not _module_file(ROOT / "packrat" / parts[1]):
        return _key_or_logger(name)
    for cut in range(len(parts), 0, -1):
        module = _module_file(ROOT.joinpath(*parts[:cut]))
        if module:
            rest = parts[cut:]
            # One name defined in the module (a class's attribute after it is not checked).
            return not rest or rest[0] in _top_level_names(module)
    return False


def _missing_in(doc: Path) -> list[str]:
    text = doc.read_text()
    missing = []
    for span in BACKTICKED.findall(text) + re.findall(r"^```.*?^```", text, flags=re.S | re.M):
        for token in _path_tokens(span):
            if not (ROOT / token).exists():
                missing.append(f"`{token}`")
        if DOTTED.match(span.strip()) and not _dotted_exists(span.strip()):
            missing.append(f"`{span.strip()}`")
    for target in LINK.findall(_without_fences(text)):
        if re.match(r"^[a-z]+:", target) or PLACEHOLDER.search(target):
            continue  # http:, mailto:; a placeholder
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            missing.append(f"({target})")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            missing.append(f"({target}): no heading #{anchor}")
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_what_the_doc_cites_exists(doc: Path) -> None:
    missing = _missing_in(doc)
    assert not missing, f"{doc.relative_to(ROOT)} cites what does not exist: " + ", ".join(missing)


def test_the_checks_catch_a_moved_path(tmp_path: Path) -> None:
    """The extraction itself: a stale path, module, name, link and anchor are all caught."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "# Title\n\n`packrat/autotune.py` and `packrat/cores.py`, `packrat.control.nosuch`,\n"
        "`packrat.cores.no_such_function`, `packrat.cores`, `scripts/<name>.py`, `packrat.task`,\n"
        "`packrat.no_such_key`,\n"
        "[a](nosuch.md), [b](x.md#title), [c](x.md#gone), [d](https://example.com/x).\n"
        "```bash\n.venv/bin/python scripts/nosuch.py --flag\n```\n"
    )
    assert _missing_in(doc) == [
        "`packrat/autotune.py`",
        "`packrat.control.nosuch`",
        "`packrat.cores.no_such_function`",
        "`packrat.no_such_key`",
        "`scripts/nosuch.py`",
        "(nosuch.md)",
        "(x.md#gone): no heading #gone",
    ]

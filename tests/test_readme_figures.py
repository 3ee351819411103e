"""The README's measured figures come from the results files under docs/benchmarks/.

A figure in the README is marked by a bold span followed at once by a link to
the results file that holds it: **11.4 min** ([run 12](docs/benchmarks/x.md)).
Every number in the span must appear in that file, with its unit where the span
gives one (5.47x, 684 s); the paragraph around the mark must name the file's CPU
and no other. A speed-up (5.1x) or a time in min/ms outside such a span fails,
so an unsourced figure cannot slip in. The per-machine summaries must be what
scripts/benchmark_summary.py writes from the results files.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKED = re.compile(r"\*\*([^*]+)\*\*\s*\(\[[^\]]*\]\((docs/benchmarks/[^)#\s]+)(?:#[^)]*)?\)")
FIGURE = re.compile(r"(\d+(?:\.\d+)?)(?:\s*(x|%|min|ms|s)(?!\w))?")
MEASURED_LOOKING = re.compile(r"\d+(?:\.\d+)?\s*(?:x\b|min\b|ms\b)")
CPUS = ("EPYC", "Xeon")
SUMMARY_SCRIPT = ROOT / "scripts" / "benchmark_summary.py"


def summary_module():
    spec = importlib.util.spec_from_file_location("benchmark_summary", SUMMARY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def prose(text: str) -> str:
    """The README without its fenced code blocks (commands, not figures)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def in_file(number: str, text: str, unit: str = "") -> bool:
    # 5.1 must not match inside 15.12 or 5.12: the number stands alone, then its unit.
    tail = rf"\s*{re.escape(unit)}(?!\w)" if unit else r"(?![\d])"
    return re.search(rf"(?<![\d.]){re.escape(number)}(?!\.\d){tail}", text) is not None


def paragraph_around(text: str, span: str) -> str:
    return next(p for p in re.split(r"\n\s*\n", text) if f"**{span}**" in p)


def test_readme_has_marked_figures() -> None:
    marks = MARKED.findall(README.read_text())
    assert len(marks) >= 3, f"the README marks {len(marks)} figures; its claims need sources"


def test_each_marked_figure_is_in_its_results_file() -> None:
    wrong = []
    for span, link in MARKED.findall(README.read_text()):
        source = ROOT / link
        assert source.is_file(), f"{link} (cited for {span!r}) does not exist"
        text = source.read_text()
        wrong += [f"{n}{u and ' ' + u} ({span!r}) not in {link}"
                  for n, u in FIGURE.findall(span) if not in_file(n, text, u)]
    assert not wrong, "\n".join(wrong)


def test_each_marked_figure_names_its_machine() -> None:
    readme, read_run = README.read_text(), summary_module().read_run
    wrong = []
    for span, link in MARKED.findall(readme):
        machine = read_run(ROOT / link).machine
        around = paragraph_around(readme, span)
        wrong += [f"{span!r}: the paragraph {'names' if cpu in around else 'lacks'} {cpu}; "
                  f"{link} ran on {machine}"
                  for cpu in CPUS if (cpu in around) != (cpu in machine)]
    assert not wrong, "\n".join(wrong)


def test_no_unmarked_measured_figure() -> None:
    text = prose(README.read_text())
    unmarked = MARKED.sub("", text)
    stray = MEASURED_LOOKING.findall(unmarked)
    assert not stray, f"figures without a results file in the README: {stray}"


def test_the_check_catches_a_figure_missing_from_its_source() -> None:
    # The marking itself: a span whose number is not in the file must be found wrong.
    fake = "**9.7 min** ([run 12](docs/benchmarks/tune-make-run-12.md))"
    (span, link), = MARKED.findall(fake)
    assert FIGURE.findall(span) == [("9.7", "min")]
    assert not in_file("9.7", (ROOT / link).read_text(), "min")
    assert in_file("11.4", (ROOT / link).read_text(), "min")
    assert not in_file("5.1", "5.12x and 15.1x")
    assert not in_file("5.5", "5.5 ms", "x") and in_file("5.5", "was 5.5x", "x")
    # A unit that is no word character keeps its unit too ("\b" after "%" never matched).
    assert FIGURE.findall("82 % and 5 s") == [("82", "%"), ("5", "s")]
    assert in_file("82", "at 82 % of", "%") and not in_file("82", "82 ms", "%")


def test_per_machine_summaries_are_current() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark_summary.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

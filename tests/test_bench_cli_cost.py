"""packrat.bench.cli_cost: a `packrat status` call timed from two git worktrees against a
stand-in controller, and the results file docs/benchmarks' summaries read."""

from __future__ import annotations

import subprocess
from pathlib import Path

from packrat.bench.cli_cost import MODELS, CliCost, measure, report
from packrat.bench.summaries import read_run

ROOT = Path(__file__).resolve().parents[1]


def test_both_commits_are_timed_in_rounds_and_the_results_file_reads_back(tmp_path: Path) -> None:
    opts = CliCost(a="HEAD", b="HEAD", name="t", rounds=1, out_dir=tmp_path, repo=ROOT, command="test")
    m = measure(opts)
    assert m["commits"]["A"] == m["commits"]["B"] and len(m["commits"]["A"]) >= 7
    for side in ("A", "B"):  # one round of A B B A: two calls each, each a real process's CPU
        assert len(m["cpu"][side]) == len(m["wall"][side]) == 2
        assert all(0 < cpu for cpu in m["cpu"][side]) and all(0 < wall for wall in m["wall"][side])
    md = tmp_path / "cli-cost-t.md"
    md.write_text(report(opts, m))
    run = read_run(md)
    assert run.command == "test" and run.figures.startswith("B/A CPU a packrat status call ")
    assert f"{len(MODELS)} models" in md.read_text() and f"| A {m['commits']['A']} |" in md.read_text()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "packrat-cli-cost-" not in worktrees  # both removed again

"""The efficiency benchmark (issue 35 item 1): raw, handler, served and peer (LitServe) figures
of one model, mode, plan and payload in one run, and the CPU time of every process per request."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from packrat.bench.efficiency import EfficiencySettings, core_blocks, level_row, parse_plan, run_efficiency
from packrat.bench.efficiency_report import last_run, render, summarise
from packrat.bench.peer import peer_missing
from packrat.bench.machine import describe_machine
from packrat.bench.proc_cpu import CpuWindow, command_name, group_members
from packrat.errors import ConfigError


def test_parse_plan_reads_both_spellings_and_mixed_plans() -> None:
    assert parse_plan("2x(t1,b4)") == [(1, 4), (1, 4)]
    assert parse_plan("1x(2t,b8) + 1x(t1,b8)") == [(2, 8), (1, 8)]
    for bad in ("2x(t1)", "0x(t1,b4)", "fat"):
        with pytest.raises(ConfigError):
            parse_plan(bad)


def test_core_blocks_are_consecutive_and_refuse_too_many_threads() -> None:
    assert core_blocks([(2, 4), (1, 4)], (4, 5, 6)) == [[4, 5], [6]]
    with pytest.raises(ConfigError, match="needs 3 cores"):
        core_blocks([(2, 4), (1, 4)], (0, 1))


def test_level_row_sums_throughput_and_derives_cpu_per_item_from_the_workers_own_time() -> None:
    def point(batch: int, mean_ms: float, cpu_share: float, pid: int) -> dict:
        # 8 calls (2 warm-up) in 0.4 s of one thread: CPU per call = share x 400 ms / 8
        return {"threads": 1, "batch": batch, "mean_ms": mean_ms, "p50_ms": mean_ms, "p99_ms": 2 * mean_ms,
                "count": 6, "meta": {"warmup_calls": 2, "elapsed_s": 0.4, "cpu_share": cpu_share, "pid": pid,
                                     "loadavg_1m": [0.0, 0.0]}}

    row = level_row([point(4, 50.0, 1.0, 1), point(4, 40.0, 0.5, 2)], [[0], [1]])
    assert row["items_per_s"] == pytest.approx(4 * 1000 / 50 + 4 * 1000 / 40)  # 80 + 100
    assert [i["cpu_ms_per_call"] for i in row["instances"]] == [50.0, 25.0]
    # CPU per second: 50 ms x 20 calls/s + 25 ms x 25 calls/s = 1625 ms over 180 items/s
    assert row["cpu_ms_per_item"] == pytest.approx(1625 / 180, abs=1e-3)
    assert (row["p50_ms"], row["p99_ms"]) == (50.0, 100.0)  # the slowest worker's


def test_cpu_window_reads_a_busy_child_and_not_an_idle_one() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass\nimport sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        time.sleep(0.2)  # both interpreters started
        window = CpuWindow.start({busy.pid: "busy", idle.pid: "idle"})
        time.sleep(1.5)
        got = window.stop()
    finally:
        for p in (busy, idle):
            p.communicate(b"")
    assert got["busy"]["pid"] == busy.pid
    assert got["busy"]["cpu_ms"] >= 150  # most of its 0.5 s loop fell in the window
    assert got["idle"]["cpu_ms"] <= 30


def test_command_name_says_which_module_or_script_a_python_runs(tmp_path: Path) -> None:
    (tmp_path / "waiter.py").write_text("import sys\nsys.stdin.read()\n")
    procs = [subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, cwd=tmp_path)
             for args in (["-m", "waiter"], [str(tmp_path / "waiter.py"), "--x"])]
    try:
        for p in procs:  # the kernel fills a new program's cmdline just after exec returns to Popen
            while not Path(f"/proc/{p.pid}/cmdline").read_bytes():
                time.sleep(0.01)
        names = [command_name(p.pid) for p in procs]
    finally:
        for p in procs:
            p.communicate(b"")
    assert names == ["waiter", f"{Path(sys.executable).name} waiter.py"]


TWO = len(os.sched_getaffinity(0)) >= 2
WORKERS = 2 if TWO else 1


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[dict[str, Any]]]:
    """One short run on tiny-bert (the peer level too when litserve is installed):
    its directory, summary.md and the rows of results.jsonl. Windows of 1 s still hold
    hundreds of requests (>= 10 asserted); warm_max_s leaves 2 s past warm_s for a JIT chunk."""
    out = tmp_path_factory.mktemp("efficiency")
    s = EfficiencySettings(model="tiny-bert", out=out, mode="fp32-eager", plan=f"{WORKERS}x(t1,b2)", rounds=2,
                           seconds=0.6, served_s=1.0, warm_s=1.0, warm_max_s=3.0, rewarm_s=0.5, max_length=8,
                           command="test")
    summary_md = run_efficiency(s).read_text()
    return out, summary_md, last_run(out / "results.jsonl")


@pytest.mark.torchserve
@pytest.mark.slow
def test_efficiency_on_a_tiny_model_every_row_positive_and_ratios_are_quotients(
        tiny_run: tuple[Path, str, list[dict[str, Any]]]) -> None:
    _, summary_md, rows = tiny_run
    peer = [] if peer_missing() else ["peer"]
    kinds = [r["kind"] for r in rows]
    assert kinds[:3] == ["run", "swap", "warm"] and kinds[-1] == "summary"
    # The warm-up followed the JVM's JIT compilers: it found their threads (C1 compiles from the
    # start), went on past warm_s in chunks until one was quiet or warm_max_s, and says which.
    warm = rows[2]
    assert warm["jit_cpu_ms_since_start"] > 0
    assert 1.0 <= warm["warm_s"] <= 3.0 + 10.0 and all(c >= 0 for c in warm["jit_cores_by_chunk"])
    assert warm["jit_quiet"] == (bool(warm["jit_cores_by_chunk"]) and warm["jit_cores_by_chunk"][-1] < 0.01)
    assert f"Served warm-up: {warm['warm_s']:g} s of load" in summary_md
    # Each chunk followed a window's reads (their first set the JIT recompiling: Served.warm).
    assert warm["reads_each_chunk"] is True and "each after the reads made before a window" in summary_md
    rounds = [r for r in rows if "round" in r]
    assert [r["kind"] for r in rounds] == ["raw", "handler", "served", *peer] * 2  # interleaved, round by round
    assert [r["round"] for r in rows if r["kind"] == "served"] == [1, 2]
    workers = WORKERS
    for r in rounds:
        for figure in ("items_per_s", "p50_ms", "p99_ms", "cpu_ms_per_item"):
            assert r[figure] > 0, (r["kind"], figure, r[figure])
        if r["kind"] not in ("served", "peer"):
            assert len(r["instances"]) == workers and all(i["batch"] == 2 for i in r["instances"])
            continue
        assert r["clients"] == 2 * workers and r["load"]["errors"] == 0 and r["requests"] >= 10
        if r["kind"] == "peer":
            continue  # checked by test_efficiency_peer_level_serves_the_same_archive_through_litserve_pinned
        cpu = r["cpu"]
        labels = [k for k in cpu if k.startswith("worker ")]
        assert len(labels) == workers
        for label in [*labels, "frontend JVM", "client (the load generator, this process)"]:
            assert cpu[label]["cpu_ms"] > 0 and cpu[label]["ms_per_request"] > 0, (label, cpu)
        # the JIT's share is read from the JVM's own threads: a part of the JVM's figure (ticks)
        assert 0 <= r["jvm_jit_ms_per_request"] <= cpu["frontend JVM"]["ms_per_request"] + 1e-3
        assert r["cpu_ms_per_item"] == pytest.approx(
            sum(v["cpu_ms"] for v in cpu.values() if v["cpu_ms"] is not None) / r["requests"], abs=1e-3)

    # Each level's figure is the median over its rounds; each ratio is the quotient of two.
    med = {k: statistics.median(r["items_per_s"] for r in rows if r["kind"] == k) for k in ("raw", "handler", "served")}
    summary = rows[-1]
    assert summary["levels"]["served"]["items_per_s"] == med["served"]
    assert summary["ratios"]["served/handler"] == pytest.approx(med["served"] / med["handler"], rel=1e-12)
    assert summary["ratios"]["handler/raw"] == pytest.approx(med["handler"] / med["raw"], rel=1e-12)
    assert summarise(rows) == {k: v for k, v in summary.items() if k in ("levels", "ratios", "cpu", "peer_cpu")}
    assert f"served/handler = {med['served'] / med['handler']:.3f}" in summary_md
    assert f"handler/raw = {med['handler'] / med['raw']:.3f}" in summary_md
    for r in sorted({row["round"] for row in rows if "round" in row}):  # each round's served / raw
        fig = {row["kind"]: row["items_per_s"] for row in rows if row.get("round") == r}
        assert f"| {fig['served'] / fig['raw']:.3f} | {fig['served'] / fig['handler']:.3f} |" in summary_md, r
    assert describe_machine().cpu in summary_md and "| frontend JVM |" in summary_md
    if not peer:  # the run said why it has no peer level, and the summary does too
        assert rows[0]["peer_skipped"] == peer_missing() and f"| peer | skipped: {peer_missing()} |" in summary_md
    # The TorchServe it started is gone.
    assert group_members(rows[1]["torchserve_pgid"]) == []


@pytest.mark.torchserve
@pytest.mark.slow
def test_efficiency_peer_level_serves_the_same_archive_through_litserve_pinned(
        tiny_run: tuple[Path, str, list[dict[str, Any]]]) -> None:
    if missing := peer_missing():
        pytest.skip(f"the peer level needs litserve (make setup installs it with the test extra): {missing}")
    out, summary_md, rows = tiny_run
    ready = next(r for r in rows if r["kind"] == "peer_ready")
    assert ready["server"] == "litserve 0.2.19"
    # One worker per plan worker, each pinned to its own block of the run's cores, one torch thread.
    blocks = rows[0]["cores"]
    assert [w["cores"] for w in ready["workers"]] == blocks
    for w, block in zip(ready["workers"], blocks):
        assert w["observed"]["cpus_allowed_list"] == ",".join(map(str, block)) and w["observed"]["torch_threads"] == 1
    peer_rows = [r for r in rows if r["kind"] == "peer"]
    assert [r["round"] for r in peer_rows] == [1, 2]
    for r in peer_rows:
        cpu = r["cpu"]
        labels = [k for k in cpu if k.startswith("peer worker ")]
        assert len(labels) == WORKERS
        for label in [*labels, "client (the load generator, this process)"]:
            assert cpu[label]["cpu_ms"] > 0, (label, cpu)
        # Which of LitServe's HTTP servers accepts a connection is its processes' race for the
        # shared socket (the lean client opens its few connections at once): their sum is measured.
        servers = [k for k in cpu if k.startswith("peer HTTP server ")]
        assert servers and sum(cpu[k]["cpu_ms"] for k in servers) > 0, cpu
        pids = {v["pid"] for k, v in cpu.items() if k.startswith("peer worker ")}
        assert pids == {w["pid"] for w in ready["workers"]}
        assert r["cpu_ms_per_item"] == pytest.approx(
            sum(v["cpu_ms"] for v in cpu.values() if v["cpu_ms"] is not None) / r["requests"], abs=1e-3)
    summary = rows[-1]
    med = {k: statistics.median(r["items_per_s"] for r in rows if r["kind"] == k) for k in ("served", "peer")}
    assert summary["ratios"]["served/peer"] == pytest.approx(med["served"] / med["peer"], rel=1e-12)
    assert f"served/peer = {med['served'] / med['peer']:.3f}" in summary_md
    assert "| peer worker 1 (cores" in summary_md
    # A run without the peer level renders it as skipped, with the reason the run gave.
    run = {**rows[0], "peer_skipped": "not asked for (--no-peer)"}
    md = render([run, *(r for r in rows[1:-1] if r["kind"] not in ("peer", "peer_ready"))])
    assert "| peer | skipped: not asked for (--no-peer) |" in md and "served/peer = n/a" in md
    # The peer's process group is gone.
    assert group_members(ready["pgid"]) == []

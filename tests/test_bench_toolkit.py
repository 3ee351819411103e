"""One bench toolkit: one percentile (pinned on a hand-computed example), one load generator,
one machine description, and scripts that are thin command lines over packrat.bench (no
function but main, at most SCRIPT_MAX_CODE_LINES lines of code).

The structural checks read the source (ast or text), as tests/test_layout.py does: a
second percentile, a script that edits sys.path or imports from tests/, or an HTTP
client built outside packrat.bench.loadgen fails here with the file named.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from packrat.bench.loadgen import PoissonLoad, Sample, latency_summary
from packrat.bench.localserver import LocalServer, local_server
from packrat.bench.machine import FLAGS_OF_INTEREST, Machine, cpu_flags, describe_machine, family_model, isa_summary
from packrat.bench.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
BENCH = sorted((ROOT / "packrat" / "bench").rglob("*.py"))
PACKRAT = sorted((ROOT / "packrat").rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the one percentile ------------------------------------------------------------------


def test_percentile_is_linear_interpolation_on_a_hand_computed_example() -> None:
    values = [50.0, 15.0, 40.0, 20.0, 35.0]  # sorted: 15 20 35 40 50, n = 5
    # p40: h = 0.40 * (5 - 1) = 1.6 -> x[1] + 0.6 * (x[2] - x[1]) = 20 + 0.6 * 15 = 29
    assert percentile(values, 40) == pytest.approx(29.0)
    # p99: h = 0.99 * 4 = 3.96 -> 40 + 0.96 * (50 - 40) = 49.6 (nearest rank would say 50)
    assert percentile(values, 99) == pytest.approx(49.6)
    assert percentile(values, 50) == 35.0
    assert (percentile(values, 0), percentile(values, 100)) == (15.0, 50.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


_PERCENTILE_CODE = re.compile(r"def _?percentile\(|np\.percentile\(|np\.quantile\(|statistics\.quantiles\(|"
                              r"int\(round\(q|\* \(len\(\w+\) - 1\)\)")


def test_there_is_one_percentile_implementation() -> None:
    found = sorted(_rel(p) for p in [*PACKRAT, *SCRIPTS] if _PERCENTILE_CODE.search(p.read_text()))
    # bench.stats is the one the benchmarks report; the profiler's stats (a floor below
    # packrat.bench, which it may not import) calls numpy's default, the same method.
    assert found == ["packrat/bench/stats.py", "packrat/profile/stats.py"]
    profile_stats = (ROOT / "packrat" / "profile" / "stats.py").read_text()
    assert "method=" not in profile_stats and "interpolation=" not in profile_stats


# -- scripts are thin command lines ------------------------------------------------------


def _imports(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out


def test_no_script_edits_sys_path_or_imports_tests_or_another_script() -> None:
    local = {p.stem for p in (ROOT / "tests").glob("*.py")} | {p.stem for p in SCRIPTS} | {"tests", "scripts"}
    bad = {}
    for path in SCRIPTS:
        tree = ast.parse(path.read_text(), str(path))
        path_edits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
                      and isinstance(n.value, ast.Name) and n.value.id == "sys"]
        wrong = sorted(_imports(tree) & local)
        if path_edits or wrong:
            bad[_rel(path)] = {"sys.path at lines": path_edits, "imports": wrong}
    assert bad == {}


def _code_lines(tree: ast.Module, source: str) -> int:
    """Lines holding code: not blank, not a comment, not the module docstring."""
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(
        getattr(tree.body[0], "value", None), ast.Constant) else None
    skip = set(range(doc.lineno, doc.end_lineno + 1)) if doc else set()
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if i not in skip and line.strip() and not line.strip().startswith("#"))


def _thin(source: str) -> dict:
    """What makes a script more than a command line: functions other than main (nested ones
    and classes included), or more than SCRIPT_MAX_CODE_LINES lines of code."""
    tree = ast.parse(source)
    defined = sorted(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                        ast.ClassDef)) and n.name != "main")
    lines = _code_lines(tree, source)
    return {k: v for k, v in (("defines", defined), ("code lines", lines if lines > SCRIPT_MAX_CODE_LINES else None))
            if v}


SCRIPT_MAX_CODE_LINES = 60


def test_every_script_is_a_thin_command_line() -> None:
    # parse -> call one function of packrat.bench (or packrat) -> print or write: the
    # measurement lives in a module, where it is imported, tested and held to the
    # function-length rule; a script that grows a helper fails here with its name.
    fat = {_rel(p): why for p in SCRIPTS if (why := _thin(p.read_text()))}
    assert fat == {}


def test_the_thinness_checker_sees_a_helper_and_a_long_main() -> None:
    assert _thin('"""Doc.\n\nMore doc."""\nimport sys\n\n\ndef main():\n    return 0\n') == {}
    assert _thin("def main():\n    def inner():\n        pass\n\n\ndef helper():\n    pass\n") == {
        "defines": ["helper", "inner"]}
    long_main = "def main():\n" + "    x = 1  # set\n" * SCRIPT_MAX_CODE_LINES + "    # a comment\n\n"
    assert _thin(long_main) == {"code lines": SCRIPT_MAX_CODE_LINES + 1}


def test_the_checker_sees_a_path_edit_and_an_import_from_tests(tmp_path: Path) -> None:
    tree = ast.parse("import sys\nsys.path.insert(0, 'tests')\nfrom fuzz_support import Fuzz\n")
    assert any(isinstance(n, ast.Attribute) and n.attr == "path" for n in ast.walk(tree))
    assert "fuzz_support" in _imports(tree)


def _keyed_plain_requests(tree: ast.AST) -> list[int]:
    """Lines of `requests.get/post/put/delete/request(..., headers=...)` calls in `tree`."""
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "requests" and n.func.attr in ("get", "post", "put", "delete", "request")
            and any(k.arg == "headers" for k in n.keywords)]


def test_a_key_goes_through_a_session_that_ignores_proxies_for_loopback() -> None:
    # requests' module functions honour HTTP_PROXY for 127.0.0.1 too: a proxy named in the
    # environment would receive TorchServe's keys. Calls with headers (a key) go through
    # packrat.apply.client.session_for, which goes straight to a loopback address.
    found = {_rel(p): lines for p in PACKRAT if (lines := _keyed_plain_requests(ast.parse(p.read_text())))}
    assert found == {}
    calls = "requests.get(u, headers=h)\nrequests.get(u)\ns.post(u, headers=h)\n"
    assert _keyed_plain_requests(ast.parse(calls)) == [1]  # the checker sees the one it should


_HTTP_CLIENT = re.compile(r"requests\.Session\(|PoolManager\(|HTTPConnectionPool\(|http\.client|ThreadPoolExecutor\(")


def test_one_load_generator_builds_the_http_connections() -> None:
    # One-off requests (a reference answer, a metrics scrape) may use requests.post/get;
    # a load, i.e. a connection kept and reused or a pool of senders, comes from loadgen.
    allowed = {"packrat/bench/loadgen/connection.py", "packrat/bench/loadgen/arrivals.py",
               "packrat/bench/fuzz_campaign.py"}  # the fuzz campaign sends groups of fuzzed requests, not a load
    found = {_rel(p) for p in [*BENCH, *SCRIPTS] if _HTTP_CLIENT.search(p.read_text())}
    assert found - allowed == set()


def test_one_machine_description() -> None:
    # The CPU's name and flags are read in bench.machine (through profile.fingerprint).
    readers = re.compile(r"/proc/cpuinfo|\"lscpu\"|'lscpu'|platform\.processor\(")
    found = sorted(_rel(p) for p in [*BENCH, *SCRIPTS] if readers.search(p.read_text()))
    assert found == ["packrat/bench/machine.py"]


# -- what the toolkit does ---------------------------------------------------------------


def test_describe_machine() -> None:
    m = describe_machine()
    assert m.cpu and m.cpu != "unknown"
    assert 1 <= m.cores <= m.cpus
    assert m.memory_gib > 0
    assert set(m.flags) <= set(FLAGS_OF_INTEREST)
    d = m.as_dict()
    assert json.loads(json.dumps(d)) == d and {"cpu", "flags", "cores", "cpus", "memory_gib", "python"} <= set(d)


def test_cpu_flags_keeps_the_flags_of_interest_in_their_order() -> None:
    text = "processor\t: 0\nflags\t\t: fpu sse avx512_bf16 avx2 amx_tile ssse3\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_flags(text) == ("avx2", "avx512_bf16", "amx_tile")
    assert cpu_flags("model name\t: something\n") == ()


def test_machine_label_tells_apart_cpus_that_share_a_model_name() -> None:
    # Two VMs' lscpu both said "AMD EPYC": a Zen 3 with AVX2 alone and one with AVX-512,
    # VNNI and bf16; their figures must not be compared, so the label must differ.
    zen3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n" \
           "flags\t\t: fpu avx2\n\nprocessor\t: 1\ncpu family\t: 99\nmodel\t\t: 9\n"
    assert family_model(zen3) == "family 25 model 1"  # the first CPU's block, not the last
    assert family_model("model name\t: x\n") == ""

    def machine(flags: tuple[str, ...], fm: str) -> Machine:
        return Machine(cpu="AMD EPYC", flags=flags, cores=2, cpus=2, memory_gib=23.5, python="3.11.7",
                       family_model=fm)

    a = machine(cpu_flags(zen3), family_model(zen3))
    b = machine(("avx2", "avx512f", "avx512_vnni", "avx512_bf16"), "family 25 model 17")
    assert a.label == "AMD EPYC (family 25 model 1; avx2, no AVX-512)"
    assert b.label == "AMD EPYC (family 25 model 17; AVX-512, avx512_vnni, avx512_bf16)"
    assert machine(("avx2",), "").label != machine(("avx2", "avx512f"), "").label  # flags alone differ
    assert isa_summary(("avx2", "avx512f", "amx_tile", "amx_bf16")) == "AMX, amx_bf16"
    assert isa_summary(()) == "no AVX2"
    assert a.as_dict()["label"] == a.label and describe_machine().label.startswith(describe_machine().cpu)


def test_latency_summary_uses_the_one_percentile() -> None:
    samples = [Sample(0.0, ms / 1000, True, 200) for ms in (50, 15, 40, 20, 35)] + [Sample(0.0, 9.9, False, 0)]
    s = latency_summary(samples, digits=2)
    assert s == {"requests": 6, "failed": 1, "p50_ms": 35.0, "p99_ms": 49.6, "max_ms": 50.0}


@pytest.fixture()
def server() -> Iterator[LocalServer]:
    with local_server() as srv:
        yield srv


def test_poisson_load_counts_every_request_and_checks_every_answer(server: LocalServer) -> None:
    bodies: list[int] = []

    def body(i: int) -> bytes:
        bodies.append(i)
        return f"request {i}".encode()

    load = PoissonLoad(f"http://127.0.0.1:{server.port}/predictions/noop?fail_every=5", dict, 100.0,
                       body=body, check=lambda i, data: i % 2 == 0, threads=4).start()
    time.sleep(0.5)
    records = load.stop()
    assert len(records) == load.sent >= 5
    assert sorted(r["i"] for r in records) == sorted(bodies) == list(range(load.sent))
    for r in records:
        assert r["outcome"] in ("ok", "failed") and r["latency_s"] >= 0
    # An answer the check refuses, or an HTTP 500, is failed; only checked 200s are ok.
    assert all(r["outcome"] == "failed" for r in records if r["i"] % 2 == 1 or r["status"] == 500)
    assert any(r["status"] == 500 for r in records)
    assert any(r["outcome"] == "ok" for r in records)


def test_poisson_load_refuses_a_non_loopback_url() -> None:
    from packrat.errors import ConfigError

    with pytest.raises(ConfigError):
        PoissonLoad("http://example.com/predictions/x", dict, 1.0, body=lambda i: b"", check=lambda i, d: True)


ARGPARSE_SCRIPTS = [p.name for p in SCRIPTS if "argparse.ArgumentParser(" in p.read_text()]


def test_the_bench_scripts_are_argparse_command_lines() -> None:
    assert {"bench_modes.py", "bench_serving.py", "bench_swaps.py", "fuzz_inputs.py", "soak_swaps.py",
            "corun_gap.py"} <= set(ARGPARSE_SCRIPTS)


@pytest.mark.parametrize("script", ARGPARSE_SCRIPTS)
def test_every_script_answers_help(script: str) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout

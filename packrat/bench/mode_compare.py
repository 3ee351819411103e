"""Execution modes side by side, in one run (scripts/bench_modes.py, which says what is measured).

In process, every Packrat mode and the peers' floor (ONNX Runtime and OpenVINO called
directly); through TorchServe the best in-process mode, fat and thin; DistilBERT batch 1
for the fastest modes; or (`int8s`) int8-static against the best bf16 mode. Every
measurement is appended to a JSONL file as it lands; render() and render_int8s() read
only that file.
"""

from __future__ import annotations

import gc
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packrat.bench.handler_code import handler_module
from packrat.bench.machine import describe_machine
from packrat.bench.mode_runs import (
    Results, bench_torchserve, build_archive, last_run, load_mode, log, request_body, rss_mb, time_calls,
)

MODES = {
    "resnet50": ["fp32-eager", "fp32-torchscript", "bf16-torchscript", "fp32-onnxruntime",
                 "fp32-openvino", "bf16-openvino"],
    "bert-base": ["fp32-eager", "fp32-torchscript", "bf16-eager", "int8-eager", "fp32-onnxruntime",
                  "int8-onnxruntime", "fp32-openvino", "bf16-openvino", "int8-openvino"],
    "gpt2": ["fp32-eager", "bf16-eager", "bf16w-eager", "int8-eager"],
}
# Tiny stand-ins exercise the script quickly (same code path).
MODES.update({"tiny-resnet": MODES["resnet50"], "tiny-bert": MODES["bert-base"], "tiny-gpt2": MODES["gpt2"]})
PEERS = ("onnxruntime-fp32", "onnxruntime-int8", "openvino-default", "openvino-f32")


def bench_in_process(model: str, archive: Path, batches: list[int], budget_s: float, results: Results,
                     run: str, only: list[str] | None) -> dict[tuple[str, int], float]:
    AccuracyGuardError = handler_module("packrat_tasks.guard").AccuracyGuardError
    PrecisionError = handler_module("packrat_tasks.precision").PrecisionError

    best: dict[tuple[str, int], float] = {}
    for mode in MODES[model]:
        if only and mode not in only:
            continue
        refused = None
        try:
            task = load_mode(archive, mode)
        except AccuracyGuardError as exc:
            refused = exc.report.as_dict()
            log(f"{model} {mode}: {exc}")
            task = load_mode(archive, mode, relax_guard=True)
        except (PrecisionError, ImportError, RuntimeError, ValueError) as exc:
            results.add(run=run, kind="mode", model=model, mode=mode, error=str(exc))
            continue
        summary = task.runner.summary()
        for b in batches:
            batch = task.preprocess(task.sample_requests(b))
            stats = time_calls(lambda task=task, batch=batch: task.forward(batch), budget_s)
            results.add(run=run, kind="mode", model=model, mode=mode, batch=b, threads=summary["threads"],
                        servable=refused is None, guard=refused or summary["guard"],
                        build={k: summary[k] for k in ("build_s", "rss_mb", "rss_delta_mb", "peak_rss_mb")},
                        **stats)
            if refused is None:
                best[(mode, b)] = stats["p50_ms"]
        del task
        gc.collect()
    return best


def bench_peers(model: str, archive: Path, batches: list[int], budget_s: float, results: Results,
                run: str) -> None:
    """ONNX Runtime and OpenVINO called directly (no Packrat code on the call path)."""
    import onnxruntime as ort
    import openvino as ov
    import torch

    export_onnx = handler_module("packrat_tasks.runtime").export_onnx

    task = load_mode(archive, "fp32-eager")
    wrapped = _module_of(task)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:
        example = _tensors(task, task.preprocess(task.sample_requests(2)))
        paths = {"fp32": export_onnx(wrapped, example, tmp, "fp32")}
        paths["int8"] = export_onnx(wrapped, example, tmp, "int8")
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        core = ov.Core()
        peers = {
            "onnxruntime-fp32": ort.InferenceSession(paths["fp32"], so, providers=["CPUExecutionProvider"]),
            "onnxruntime-int8": ort.InferenceSession(paths["int8"], so, providers=["CPUExecutionProvider"]),
            "openvino-default": core.compile_model(paths["fp32"], "CPU", {"PERFORMANCE_HINT": "LATENCY"}),
            "openvino-f32": core.compile_model(paths["fp32"], "CPU", {"PERFORMANCE_HINT": "LATENCY",
                                                                      "INFERENCE_PRECISION_HINT": "f32"}),
        }
        precision_default = str(peers["openvino-default"].get_property("INFERENCE_PRECISION_HINT"))
        for b in batches:
            feeds = [t.contiguous().numpy() for t in _tensors(task, task.preprocess(task.sample_requests(b)))]
            for name, peer in peers.items():
                if name.startswith("onnxruntime"):
                    names = [i.name for i in peer.get_inputs()]
                    fn = lambda peer=peer, names=names: peer.run(None, dict(zip(names, feeds)))  # noqa: E731
                else:
                    request = peer.create_infer_request()
                    fn = lambda request=request: request.infer(feeds)  # noqa: E731
                stats = time_calls(fn, budget_s)
                extra = {"openvino_precision": precision_default} if name == "openvino-default" else {}
                results.add(run=run, kind="peer", model=model, mode=name, batch=b, threads=threads,
                            **extra, **stats)


# -- int8-static vs the best bf16 mode (issue 17) ------------------------------------

INT8S_MODES = {
    "resnet50": ["bf16-openvino", "bf16-torchscript", "int8s-openvino", "int8s-onnxruntime"],
    "bert-base": ["bf16-openvino", "int8-onnxruntime", "int8s-openvino", "int8s-onnxruntime"],
}
INT8S_MODES.update({"tiny-resnet": INT8S_MODES["resnet50"], "tiny-bert": INT8S_MODES["bert-base"]})
INT8S_TS = ("bf16-openvino", "int8s-openvino")  # the best bf16 mode, and the int8-static one


def bench_int8s_in_process(model: str, archive: Path, batch: int, rounds: int, results: Results,
                           run: str) -> dict:
    """Load every mode (build cost, memory, guard), then time B-batches round by round."""
    AccuracyGuardError = handler_module("packrat_tasks.guard").AccuracyGuardError
    PrecisionError = handler_module("packrat_tasks.precision").PrecisionError

    tasks = {}
    for mode in INT8S_MODES[model]:
        t0 = time.perf_counter()
        refused = None
        try:
            task = load_mode(archive, mode)
        except AccuracyGuardError as exc:
            refused = exc.report.as_dict()
            task = load_mode(archive, mode, relax_guard=True)
        except (PrecisionError, ImportError, RuntimeError, ValueError) as exc:
            results.add(run=run, kind="int8s-build", model=model, mode=mode, error=str(exc))
            continue
        load_s = round(time.perf_counter() - t0, 3)
        summary = task.runner.summary()
        results.add(run=run, kind="int8s-build", model=model, mode=mode, load_s=load_s,
                    servable=refused is None, guard=refused or summary["guard"], int8s=summary.get("int8s"),
                    build={k: summary[k] for k in ("build_s", "rss_mb", "rss_delta_mb", "peak_rss_mb")})
        tasks[mode] = (task, task.preprocess(task.sample_requests(batch)))
    times: dict[str, list[float]] = {m: [] for m in tasks}
    for task, b in tasks.values():
        task.forward(b)  # one more warm call each before the rounds
    loads = []
    for _ in range(rounds):  # interleaved: a load change on the shared machine hits every mode alike
        for mode, (task, b) in tasks.items():
            for _ in range(2):
                t = time.perf_counter()
                task.forward(b)
                times[mode].append((time.perf_counter() - t) * 1000)
        loads.append(os.getloadavg()[0])
    for mode, ts in times.items():
        results.add(run=run, kind="int8s-inproc", model=model, mode=mode, batch=batch, reps=len(ts),
                    p50_ms=round(statistics.median(ts), 3), min_ms=round(min(ts), 3),
                    load_avg_range=[min(loads), max(loads)])
    any_task = next(iter(tasks.values()))[0]
    body = any_task.sample_requests(1)[0]["body"]
    del tasks
    gc.collect()
    return {"body": body}


def bench_int8s_torchserve(model: str, batch: int, body: bytes, results: Results, run: str, workdir: Path,
                           requests_n: int, rounds: int) -> None:
    """Both modes side by side through one TorchServe, per shape: registration (cold build),
    worker memory, then closed-loop B clients, the modes alternating for `rounds` rounds."""
    from packrat.bench.loadgen import Target, closed_loop
    from packrat.server import start_torchserve

    cores = sorted(os.sched_getaffinity(0))
    store = workdir / "store"
    shapes = {"fat": [{"cores": cores, "threads": len(cores)}],
              "thin": [{"cores": [c], "threads": 1} for c in cores]}
    if len(cores) < 2:
        shapes.pop("thin")
    for shape, slots in shapes.items():
        for mode in INT8S_TS:
            precision, runtime = mode.split("-")
            build_archive(model, store, f"{model}-{mode}-{shape}", precision=precision, runtime=runtime,
                          batch_size=batch // len(slots), max_batch_delay_ms=5, workers=len(slots),
                          extra={"plan_id": f"bench-{mode}-{shape}-{os.getpid()}", "slots": slots})
    ctype = "image/jpeg" if "resnet" in model else "text/plain"
    server = start_torchserve(store, workdir / "ts")
    try:
        client = server.management_client()
        token = server.inference_headers()["Authorization"].split(" ", 1)[1]
        for shape, slots in shapes.items():
            names = {mode: f"{model}-{mode}-{shape}" for mode in INT8S_TS}
            for mode, name in names.items():
                t0 = time.perf_counter()
                workers = server.register(name, len(slots), timeout_s=1800)  # until every worker is READY
                register_s = round(time.perf_counter() - t0, 3)
                results.add(run=run, kind="int8s-ts-register", model=model, mode=mode, shape=shape,
                            register_s=register_s, workers=len(workers),
                            worker_rss_mb=[rss_mb(w["pid"]) for w in workers])
            for r in range(rounds):
                for mode, name in names.items():
                    target = Target(url=f"{server.inference_url}/predictions/{name}", body=body,
                                    content_type=ctype, token=token)
                    res = closed_loop(target, clients=batch, requests_count=requests_n, warmup=2 * batch,
                                      max_duration_s=300)
                    results.add(run=run, kind="int8s-ts", model=model, mode=mode, batch=batch, shape=shape,
                                round=r, **{k: v for k, v in res.summary().items() if k != "mode"})
            for name in names.values():
                client.unregister(name, "1.0")
    finally:
        server.stop()


def render_int8s(path: Path) -> str:
    rows, out = last_run(path)
    for model in dict.fromkeys(r["model"] for r in rows if r.get("model")):
        builds = {r["mode"]: r for r in rows if r.get("model") == model and r["kind"] == "int8s-build"}
        inproc = {r["mode"]: r for r in rows if r.get("model") == model and r["kind"] == "int8s-inproc"}
        if inproc:
            b = next(iter(inproc.values()))
            out += [f"#### {model}, in process, B = {b['batch']}, {b['reps']} timed calls per mode "
                    f"(interleaved; 1-min load {b['load_avg_range'][0]:.1f}–{b['load_avg_range'][1]:.1f})", "",
                    "| mode | p50 ms | min ms | images-or-texts/s (p50) | load s (build incl.) | quantise s | "
                    "+MiB | peak RSS MiB | guard |", "|---|---|---|---|---|---|---|---|---|"]
            for mode, br in builds.items():
                if "error" in br:
                    out.append(f"| {mode} | – | – | – | – | – | – | – | not run: {br['error'][:80]} |")
                    continue
                r = inproc.get(mode, {})
                g = br.get("guard")
                gtext = "–" if g is None else ("pass" if br.get("servable") else "**REFUSED**")
                if g:
                    m = g["metrics"]
                    gtext += " (" + ", ".join(f"{k} {m[k]:.4g}" for k in (
                        "top1_agreement_all", "max_prob_diff", "logit_cosine", "min_cosine") if k in m) + ")"
                q = (br.get("int8s") or {}).get("quantize_s", "–")
                thr = f"{1000 * b['batch'] / r['p50_ms']:.1f}" if r else "–"
                out.append(f"| {mode} | {r.get('p50_ms', '–')} | {r.get('min_ms', '–')} | {thr} | {br['load_s']} | {q} | "
                           f"{br['build']['rss_delta_mb']} | {br['build']['peak_rss_mb']} | {gtext} |")
            out.append("")
        ts = [r for r in rows if r.get("model") == model and r["kind"] == "int8s-ts"]
        reg = {(r["mode"], r["shape"]): r for r in rows if r.get("model") == model and r["kind"] == "int8s-ts-register"}
        if ts:
            out += [f"#### {model} through TorchServe, B = {ts[0]['batch']} closed-loop clients, token auth on", "",
                    "| shape | mode | throughput req/s per round | p50 ms per round | register s (cold build) | "
                    "worker RSS / peak MiB | load avg |", "|---|---|---|---|---|---|---|"]
            for key in dict.fromkeys((r["shape"], r["mode"]) for r in ts):
                rs = [r for r in ts if (r["shape"], r["mode"]) == key]
                g = reg.get((key[1], key[0]), {})
                out.append(f"| {key[0]} | {key[1]} | " + " / ".join(f"{r['throughput_rps']:.2f}" for r in rs)
                           + " | " + " / ".join(f"{r['p50_ms']:.1f}" for r in rs)
                           + f" | {g.get('register_s', '–')} | {g.get('worker_rss_mb', '–')} | "
                           + " / ".join(str(r.get("load_avg_1m")) for r in rs) + " |")
            out.append("")
    return "\n".join(out)


def _module_of(task):
    """The task's nn.Module wrapper (eager runner's closure holds it)."""
    for cell in task.runner.fn.__closure__ or ():
        if hasattr(cell.cell_contents, "forward") and hasattr(cell.cell_contents, "eval"):
            return cell.cell_contents
    raise RuntimeError("eager module not found")


def _tensors(task, batch) -> tuple:
    if "pixel_values" in batch.inputs:
        return (batch.inputs["pixel_values"],)
    return (batch.inputs["input_ids"], batch.inputs["attention_mask"])


def measure(models: list[str], batches: list[int], ts_batches: list[int], budget_s: float,
            only: list[str] | None, peers: bool, torchserve: bool, distil_modes: list[str], requests: int,
            out: Path) -> None:
    """The side-by-side run (distil_modes empty: no DistilBERT points)."""
    with _run(out) as (results, run, tmp):
        for mode in distil_modes:
            bench_torchserve("distilbert", mode, [1], results, run, tmp / f"ts-distil-{mode}", 100,
                             shapes=("fat",), max_length=8, label="distilbert-seq8")
        for model in models:
            archive = build_archive(model, tmp / "store", model)
            best = bench_in_process(model, archive, batches, budget_s, results, run, only)
            if peers and "gpt2" not in model:
                bench_peers(model, archive, batches, budget_s, results, run)
            if torchserve and best:
                # The mode with the lowest in-process latency summed over B.
                totals: dict[str, float] = {}
                for (mode, b), ms in best.items():
                    totals[mode] = totals.get(mode, 0.0) + ms / b
                choice = min(totals, key=totals.get)
                log(f"{model}: best in-process mode {choice}; through TorchServe")
                body, ctype = request_body(model)
                bench_torchserve(model, choice, ts_batches, results, run, tmp / f"ts-{model}",
                                 requests, body, ctype)


def measure_int8s(models: list[str], batch: int, rounds: int, torchserve: bool, requests: int,
                  ts_rounds: int, out: Path) -> None:
    """int8-static against the best bf16 mode, in process and (torchserve) through TorchServe."""
    with _run(out) as (results, run, tmp):
        for model in models:
            archive = build_archive(model, tmp / "store", model)
            got = bench_int8s_in_process(model, archive, batch, rounds, results, run)
            if torchserve:
                bench_int8s_torchserve(model, batch, got["body"], results, run, tmp / f"ts-{model}",
                                       requests, ts_rounds)


@contextmanager
def _run(out: Path) -> Iterator[tuple[Results, str, Path]]:
    """The results file with this run's machine row, the run id and a scratch folder."""
    import torch

    # SIGTERM -> SystemExit, so the finally blocks stop the TorchServe instances started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    results = Results(out)
    run = time.strftime("%Y%m%dT%H%M%S")
    results.add(run=run, kind="machine", cpu=describe_machine().label, cores=len(os.sched_getaffinity(0)),
                torch=torch.__version__, load_avg=os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="bench-modes-") as tmp:
        yield results, run, Path(tmp)


def render(path: Path) -> str:
    rows, out = last_run(path)
    machine = next((r for r in rows if r["kind"] == "machine"), {})
    for model in dict.fromkeys(r["model"] for r in rows if r.get("model")):
        mrows = [r for r in rows if r.get("model") == model and r["kind"] in ("mode", "peer")]
        if not mrows:
            continue
        batches = sorted({r["batch"] for r in mrows if "batch" in r})
        loads = [r["load_avg_1m"] for r in mrows if r.get("load_avg_1m") is not None]
        out.append(f"### {model}: ms to finish a batch of B, p50 (min), in-process forward only")
        if loads:
            out.append("")
            out.append(f"1-min load average while measuring: {min(loads):.1f}–{max(loads):.1f} "
                       f"(on {machine.get('cores')} cores).")
        out.append("")
        out.append("| path | " + " | ".join(f"B={b}" for b in batches) + " | build s | +MiB | guard |")
        out.append("|---|" + "---|" * (len(batches) + 3))
        for key in dict.fromkeys((r["kind"], r["mode"]) for r in mrows):
            cells = {r["batch"]: r for r in mrows if (r["kind"], r["mode"]) == key and "batch" in r}
            err = next((r["error"] for r in mrows if (r["kind"], r["mode"]) == key and "error" in r), None)
            label = ("Packrat " if key[0] == "mode" else "peer ") + key[1]
            if err:
                out.append(f"| {label} | " + " | ".join("–" for _ in batches) + f" | | | refused: {err[:90]} |")
                continue
            any_row = next(iter(cells.values()))
            build = any_row.get("build") or {}
            guard = any_row.get("guard")
            gtext = "" if key[0] == "peer" else ("reference" if guard is None else
                                                 ("pass" if any_row.get("servable") else "**REFUSED**"))
            if guard and key[0] == "mode":
                m = guard["metrics"]
                gtext += " (" + ", ".join(f"{k} {v:.4g}" for k, v in m.items()
                                          if isinstance(v, float) and k in (
                                              "max_prob_diff", "logit_cosine", "min_cosine", "exact_fraction")) + ")"
            if key[1] == "openvino-default":
                gtext = f"precision {any_row.get('openvino_precision')}"
            out.append(f"| {label} | " + " | ".join(
                f"{cells[b]['p50_ms']:.1f} ({cells[b]['min_ms']:.1f})" if b in cells else "–" for b in batches)
                + f" | {build.get('build_s', '')} | {build.get('rss_delta_mb', '')} | {gtext} |")
        ts = [r for r in rows if r.get("model") == model and r["kind"] == "torchserve"]
        if ts:
            out.append("")
            out.append(f"Through TorchServe ({ts[0]['mode']}, B closed-loop clients, token auth on): "
                       "p50 / p99 request latency ms")
            out.append("")
            out.append("| shape | " + " | ".join(f"B={b}" for b in batches) + " |")
            out.append("|---|" + "---|" * len(batches))
            for shape in ("fat", "thin"):
                cells = {r["batch"]: r for r in ts if r["shape"] == shape}
                if cells:
                    out.append(f"| {shape} | " + " | ".join(
                        f"{cells[b]['p50_ms']:.1f} / {cells[b]['p99_ms']:.1f}" if b in cells and cells[b].get("p50_ms")
                        else "–" for b in batches) + " |")
        out.append("")
    distil = [r for r in rows if r["kind"] == "distilbert-seq8"]
    if distil:
        out.append("### DistilBERT, 8-token input, batch 1, one client, through TorchServe")
        out.append("")
        out.append("| mode | p50 ms | p95 ms | p99 ms | min ms | requests | load avg |")
        out.append("|---|---|---|---|---|---|---|")
        for r in distil:
            out.append(f"| {r['mode']} | {r['p50_ms']} | {r['p95_ms']} | {r['p99_ms']} | "
                       f"{r.get('min_ms', '–')} | {r['ok']} | "
                       f"{r.get('load_avg_1m', '–')} |")
        out.append("")
    return "\n".join(out)

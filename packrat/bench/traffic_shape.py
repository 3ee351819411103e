"""Prediction against traffic of two shapes (issue 32, target 3): BERT-base at 8 clients,
<= 8-token and ~128-token texts, the controller's predicted latency beside the clients'.

Served as users run Packrat: a private TorchServe on free loopback ports (token auth on),
or one already running (Options.attach, `--attach`), one text model registered with one
worker, `packrat controller --no-tune` beside it (the re-plan loop on, tick 1 s; tuning
off, so the mode stays the archive's own and the plan is the one the loop picks). Its Reprofiler (packrat.control.tuning.Reprofiler) follows the
traffic's sizes of the last ~30 s: when they move a factor 1.5 from those the profile planned
from was timed at, it plans from the profile kept for that shape if one was measured (no
re-profile, no wait), else re-profiles the live mode at the traffic's sizes (each batch b
at the longest of b texts: packrat.profile.shape.sizes_by_batch; "prediction for" names the
profile's label and, where they differ, the sizes the plan's batch was timed at), beside the
serving load; one-thread points that waited for their core are corrected to the time they
computed (packrat.profile.contention). The controller starts from a profile made at 128
tokens, before anything serves, *with its sizes recorded* (ProfileSettings.sizes).

Phases, each with `clients` closed-loop clients (ContinuousLoad: every request accounted for):
A sends texts of <= 8 tokens, B texts that fill the archive's max_length (128 tokens for
BERT-base, counted by its own tokenizer); rounds repeat A B so the noise is seen. A phase:

1. loads until the controller has settled for that traffic (settled(): its own state, read
   every second from status, /v1/jobs and the loop's decisions, and the profile it plans
   from timed within the shift factor of the phase's texts as the archive's tokenizer
   counts them; SETTLE_TIMEOUT_S at most, then it is measured anyway and marked settled:
   false);
2. measures a window (window_s): the clients' p50/p99 and throughput, and each tick's
   decision of the loop.

What is compared. The controller predicts a batch's *service time*: the decision's
`current_ms` is the live plan's latency at the estimated B as profiled (the profile the loop
plans from, whose settings.sizes are the input shape it is for), `corrected_current_ms` that
times the learned correction. It exposes no predicted request latency. A closed-loop
client's latency adds the HTTP round trip, the wait for a batch to form (maxBatchDelay) and
the queue behind the batch in service, so `ratio` = client p50 / current_ms is reported
as it is, beside the like-for-like figure: the controller's own observed mean service time
(decision `observed_ms`, TorchServe's latency minus queue time) / current_ms.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packrat import settings as packrat_settings
from packrat.apply.client import session_for
from packrat.bench.adapt_rig import free_port
from packrat.bench.controller_cost import _controller_cmd, _wait_healthy
from packrat.bench.loadgen import ContinuousLoad, latency_summary
from packrat.bench.localserver import local_server
from packrat.bench.machine import describe_machine
from packrat.bench.results import ResultLog, shape_label
from packrat.profile.shape import MIN_REQUESTS, shifted, timed_sizes
from packrat.profile.store import load_profile, save_profile

SETTLE_TIMEOUT_S = 900.0  # a re-profile per new shape, and the Reprofiler's 300 s gap between two
SETTLED_REASONS = ("same-plan", "gain-below-threshold")  # the loop would not swap: settled
TICK_FIELDS = ("time_s", "reason", "swap", "estimated_batch", "current_ms", "corrected_current_ms",
               "observed_ms", "latency_gap")
TARGET_BAND = 0.25  # issue 32: predicted p50 within +-25 % of observed (or the run's own noise band)
START_SIZES = (("tokens", 128),)  # the task's sample: a text of max_length tokens

SHORT_TEXTS = (b"great movie", b"not bad at all", b"I loved it", b"too long",
               b"a fine day out", b"worst service ever")  # 3-6 tokens with [CLS] and [SEP]
_SENTENCES = ("the film opens slowly and the first hour drags on without much happening",
              "then the story finds its pace and the two leads carry every scene together",
              "the music is good but far too loud in the quiet moments near the end",
              "some of the jokes land well while others feel old and a little tired",
              "the camera work is clean and the city at night looks warm and alive",
              "i would watch it again with friends though maybe not at full price",
              "the ending ties the threads up neatly and leaves a small door open")


def built_archive(arch: str, store: Path, precision: str, runtime: str) -> Path:
    """The named architecture built (once) into `store` in that precision and runtime."""
    from packrat.archive import ArchiveOptions, build_named

    opts = ArchiveOptions(runtime=runtime, precision=precision)
    return build_named(arch, store, f"{arch}-{precision}-{runtime}", opts, reuse_current=True)


def long_texts(model_dir: Path | None = None, words: int = 120) -> tuple[bytes, ...]:
    """One text per starting sentence: `words` plain words, or with `model_dir` (an archive)
    as many as fit its max_length counted by its own tokenizer, [CLS] and [SEP] included
    (128 for BERT-base; a longer text is refused with 413, not truncated)."""
    fit = _fitter(model_dir) if model_dir is not None else (lambda ws: ws[:words])
    out = []
    for k in range(len(_SENTENCES)):
        pool = (" ".join(_SENTENCES[k:] + _SENTENCES[:k]) + " ") * 4
        out.append(" ".join(fit(pool.split())).encode())
    return tuple(out)


def _tokenizer(model_dir: Path) -> tuple[Any, int]:
    """The archive's own tokenizer and its max_length."""
    import yaml
    from transformers import AutoTokenizer

    cfg = yaml.safe_load((model_dir / "model_config.yaml").read_text())["packrat"]
    return AutoTokenizer.from_pretrained(model_dir / cfg.get("model_dir", "model")), int(cfg["max_length"])


def sent_sizes(model_dir: Path, texts: Sequence[bytes]) -> dict[str, int]:
    """The size a phase's texts are planned at: the most tokens of any (a batch is padded
    to its longest; [CLS] and [SEP] included, as the served worker counts them)."""
    tok, _ = _tokenizer(model_dir)
    return {"tokens": max(len(tok(t.decode())["input_ids"]) for t in texts)}


def _fitter(model_dir: Path) -> Any:
    """words -> the longest prefix whose tokens fit the archive's max_length."""
    tok, limit = _tokenizer(model_dir)

    def fit(ws: list[str]) -> list[str]:
        n = next((i for i in range(min(len(ws), limit), 0, -1)
                  if len(tok(" ".join(ws[:i]))["input_ids"]) <= limit), 0)
        return ws[:n]

    return fit


def phases(model_dir: Path | None = None) -> dict[str, tuple[str, tuple[bytes, ...]]]:
    """Phase -> (what its texts are, the texts)."""
    return {"A": ("<= 8 tokens", SHORT_TEXTS), "B": ("~max_length tokens", long_texts(model_dir))}


PHASES = phases()  # the labels and the texts without an archive's tokenizer


@dataclass(frozen=True)
class Options:
    model_dir: Path  # the archive (its directory's name is the model's)
    out_jsonl: Path
    start_profile: Path | None = None  # None: measured here at START_SIZES first
    rounds: int = 2
    clients: int = 8
    window_s: float = 20.0
    settle_timeout_s: float = SETTLE_TIMEOUT_S
    hold_s: float = 10.0  # settled for this long before the window opens
    profile_budget_s: float = 120.0
    profile_max_batch: int = 8
    round_trip_s: float = 3.0  # the generator's own round trip is measured this long
    # Workdir of a TorchServe already running (packrat.server, as `packrat bench --attach`):
    # served there, the model added to its store and removed again; None: a private one.
    attach: Path | None = None
    command: str = ""


@dataclass
class Serving:
    """What one run started: TorchServe, the controller's API, its state dir."""

    server: Any
    api: str
    state: Path
    model: str
    log: ResultLog
    opts: Options
    texts: dict[str, tuple[str, tuple[bytes, ...]]]  # phase -> (label, texts): phases()
    sent: dict[str, dict[str, int]]  # phase -> the sizes its texts are planned at (sent_sizes)

    def get(self, path: str, **params: Any) -> Any:
        with session_for(self.api) as direct:  # the key goes to the controller, never via a proxy
            r = direct.get(f"{self.api}{path}", headers=self.server.management_headers(), params=params, timeout=60)
        r.raise_for_status()
        return r.json()


# -- the controller's state ---------------------------------------------------------------


def planned_from(state: Path, model: str, mode: str | None) -> tuple[str, dict[str, int]]:
    """(file, sizes) of the profile the loop plans from: the live mode's per-mode profile
    (where a re-profile writes it), else the one placed at profiles/<model>.json, as
    packrat.control.planning.Planner.profile picks it (its validity checks left out)."""
    per_mode = state / "profiles" / model / f"{mode}.json"
    path = per_mode if mode is not None and per_mode.exists() else state / "profiles" / f"{model}.json"
    return str(path.relative_to(state)), timed_sizes(load_profile(path))


def profile_facts(path: Path) -> dict[str, Any]:
    """When the profile planned from was made, and its points corrected for the time they
    waited for a core or marked contended (packrat.profile.contention): a kept profile
    restored for a returning shape keeps its own `created`."""
    prof = load_profile(path)
    shared = prof.extra.get("contention") or {}
    by_batch = {str(pt.batch): pt.meta.get("sizes") for pt in prof.points if pt.meta.get("sizes")}
    return {"created": prof.extra.get("created"), "corrected": len(shared.get("corrected", [])),
            "contended": len(shared.get("contended", [])),
            # the sizes each batch was timed at (a profile of traffic times batch b at the
            # longest of b texts: packrat.profile.shape.sizes_by_batch)
            "timed_by_batch": by_batch}


def traffic_sizes(status: dict[str, Any], batch: int) -> dict[str, int]:
    """The traffic's representative sizes as status shows them: p50 at B = 1, p90 for a
    padded kind at B > 1 (the Reprofiler takes the quantile 0.5 ** (1 / B): 0.92 at B = 8)."""
    out = {}
    for kind, row in (status.get("traffic") or {}).items():
        if row.get("requests", 0) >= MIN_REQUESTS:
            out[kind] = max(1, round(row["p90"] if batch > 1 and kind != "pixels" else row["p50"]))
    return out


def settled(sv: Serving, phase: str) -> tuple[bool, dict[str, Any]]:
    """Whether the controller has settled for the phase's traffic now (module doc), and what
    it read. The profile planned from is compared with the phase's texts (sv.sent), not with
    status's traffic: the workers count since they started, so after a phase of short texts
    their median stays short for minutes of long ones."""
    st = sv.get(f"/v1/models/{sv.model}/status")
    decisions = sv.get(f"/v1/models/{sv.model}/adapt", last=1).get("decisions") or []
    d = decisions[-1] if decisions else None
    jobs = [j for j in sv.get("/v1/jobs", model=sv.model) if j["state"] in ("queued", "running")]
    batch = (st.get("plan") or {}).get("batch") or 1
    _, made_at = planned_from(sv.state, sv.model, st.get("mode"))
    now = traffic_sizes(st, batch)
    # A profile without sizes is never re-profiled for the traffic: nothing to wait for.
    shape_ok = bool(now) and (not made_at or not shifted(made_at, sv.sent[phase]))
    ok = (d is not None and d["reason"] in SETTLED_REASONS and d["estimate"]["ready"]
          and not d["estimate"]["idle"] and st.get("swap_in_progress") is None and not jobs and shape_ok)
    return ok, {"reason": d["reason"] if d else None, "jobs": len(jobs), "traffic": now, "made_at": made_at,
                "sent": sv.sent[phase]}


def wait_settled(sv: Serving, phase: str, started: float) -> dict[str, Any]:
    """Poll settled() every second until it has held hold_s, or settle_timeout_s passed."""
    since, seen = None, {}
    while time.monotonic() - started < sv.opts.settle_timeout_s:
        ok, seen = settled(sv, phase)
        now = time.monotonic()
        since = (since or now) if ok else None
        if since is not None and now - since >= sv.opts.hold_s:
            return {"settled": True, "settled_after_s": round(since - started, 1), "at_window": seen}
        time.sleep(1.0)
    return {"settled": False, "settled_after_s": None, "at_window": seen}


# -- one phase ---------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 2) if vals else None


def window_decisions(sv: Serving, seconds: float) -> tuple[list[dict[str, Any]], float, float]:
    """Each tick's decision of the loop over `seconds` (polled each second, one per tick)."""
    w0, out, seen = time.monotonic(), [], set()
    while time.monotonic() - w0 < seconds:
        for d in sv.get(f"/v1/models/{sv.model}/adapt", last=5).get("decisions") or []:
            if d["time_s"] not in seen:
                seen.add(d["time_s"])
                out.append(d)
        time.sleep(1.0)
    return out, w0, time.monotonic()


def predicted(decisions: list[dict[str, Any]]) -> dict[str, Any]:
    """The loop's prediction over the window: medians of its ticks' figures."""
    batches = [d["estimated_batch"] for d in decisions]
    return {
        "field": "decision current_ms (live plan at the estimated B, as profiled)",
        "current_ms": _median([d["current_ms"] for d in decisions]),
        "corrected_current_ms": _median([d["corrected_current_ms"] for d in decisions]),
        "observed_service_ms": _median([d["observed_ms"] for d in decisions]),
        "estimated_batch": max(set(batches), key=batches.count) if batches else None,
        "reasons": sorted({d["reason"] for d in decisions}),
        "ticks": [{k: d[k] for k in TICK_FIELDS} for d in decisions],  # the raw figures
    }


def _phase_events(sv: Serving, wall0: float) -> dict[str, Any]:
    """Swaps and re-profiles the controller started since `wall0` (wall clock)."""
    swaps = [s for s in sv.get("/v1/swaps", last=200) if s["model"] == sv.model and s["started_at"] >= wall0]
    jobs = [j for j in sv.get("/v1/jobs", model=sv.model, last=50)
            if j["kind"] == "profile" and j["created"] >= wall0]
    return {
        "swaps": len(swaps), "swaps_failed": sum(1 for s in swaps if s["outcome"] != "applied"),
        "swapped_to": [shape_label([(i["threads"], i["batch"]) for i in s["plan"]["instances"]]) for s in swaps],
        "reprofiles": [{"state": j["state"], "after_s": round(j["created"] - wall0, 1),
                        "took_s": round(j["finished"] - j["created"], 1) if j.get("finished") else None,
                        "error": j.get("error")} for j in jobs],
    }


def run_phase(sv: Serving, rnd: int, name: str) -> dict[str, Any]:
    """One phase (module doc): load, wait for the controller, measure; the record."""
    texts, bodies = sv.texts[name]
    srv = sv.server
    load = ContinuousLoad(f"{srv.inference_url}/predictions/{sv.model}", srv.inference_headers(), bodies,
                          check=lambda _i, _b: True, clients=sv.opts.clients)  # HTTP 200 is checked by the load
    wall0, t0 = time.time(), time.monotonic()
    load.start()
    try:
        wait = wait_settled(sv, name, t0)
        decisions, w0, w1 = window_decisions(sv, sv.opts.window_s)
        st = sv.get(f"/v1/models/{sv.model}/status")
    finally:
        samples = load.stop()
    # the requests answered within the window (one sent just before it counts: it was served in it)
    in_window = [s for s in samples if w0 <= s.start + s.latency_s <= w1]
    obs = latency_summary(in_window, 2)
    if not any(s.ok for s in in_window):  # nothing answered: no latency, not 0 ms
        obs.update(p50_ms=None, p99_ms=None)
    obs["throughput_rps"] = round(sum(1 for s in in_window if s.ok) / (w1 - w0), 2)
    pred = predicted(decisions)
    profile_file, made_at = planned_from(sv.state, sv.model, st.get("mode"))
    plan = st.get("plan") or {}
    rec = {
        "round": rnd, "phase": name, "texts": texts, "clients": sv.opts.clients, **wait,
        "window_s": round(w1 - w0, 1), "observed": obs, "predicted": pred,
        "ratio": _ratio(obs["p50_ms"], pred["current_ms"]),
        "ratio_corrected": _ratio(obs["p50_ms"], pred["corrected_current_ms"]),
        "service_ratio": _ratio(pred["observed_service_ms"], pred["current_ms"]),
        "predicted_for": made_at, "planned_from": profile_file, "sent": sv.sent[name],
        "profile": profile_facts(sv.state / profile_file),
        "traffic": (st.get("traffic") or {}).get("tokens"), "mode": st.get("mode"),
        "plan": shape_label([(i["threads"], i["batch"]) for i in plan.get("instances", [])]) or None,
        "plan_batch": plan.get("batch"), "plan_predicted_ms": st.get("predicted_latency_ms"),
        "instance_batches": sorted({int(i["batch"]) for i in plan.get("instances", [])}),
        **_phase_events(sv, wall0),
        "requests": len(samples), "failed": sum(1 for s in samples if not s.ok),
        "errors": sorted({s.error for s in samples if s.error})[:5],
    }
    return sv.log.append("phase", rec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# -- the run -----------------------------------------------------------------------------


def round_trip(clients: int, seconds: float = 3.0) -> dict[str, Any]:
    """The load generator's own round trip at `clients` clients: the same ContinuousLoad against
    a loopback server that answers at once (packrat.bench.localserver), before anything serves.
    What a client's latency holds besides TorchServe's time (in this process, as the phases)."""
    with local_server() as srv:
        load = ContinuousLoad(f"http://127.0.0.1:{srv.port}/", {}, SHORT_TEXTS, check=lambda _i, _b: True,
                              clients=clients).start()
        time.sleep(seconds)
        return {"clients": clients, **latency_summary(load.stop(), 3)}


def start_profile(opts: Options, dest: Path) -> dict[str, Any]:
    """The profile the controller starts from: the given one, else measured here (before
    anything serves) in the archive's mode at START_SIZES, its sizes recorded."""
    if opts.start_profile is not None:
        shutil.copyfile(opts.start_profile, dest)
        return {"start_profile": str(opts.start_profile), "made_at": timed_sizes(load_profile(dest))}
    from packrat.profile import ProfileSettings, open_archive, run_profile
    from packrat.cores import usable_cores

    t0 = time.monotonic()
    settings = ProfileSettings(cores=len(usable_cores().cores), max_batch=opts.profile_max_batch,
                               budget_s=opts.profile_budget_s, sizes=START_SIZES)
    save_profile(run_profile(open_archive(opts.model_dir), settings, progress=False,
                             log_path=dest.with_suffix(".log")), dest)
    return {"start_profile": "measured", "made_at": dict(START_SIZES), "took_s": round(time.monotonic() - t0, 1)}


@contextlib.contextmanager
def serving(opts: Options, root: Path, log: ResultLog) -> Iterator[Serving]:
    """TorchServe with the model registered (one worker) and `packrat controller --no-tune`
    beside it; both stopped on the way out, also on failure. Attached (opts.attach), the
    server is left running, the model unregistered and its files removed from its store."""
    from packrat.bench.adapt_rig import remove_model
    from packrat.server import RunningServer, start_torchserve

    model = opts.model_dir.name
    attached = RunningServer.attach(opts.attach) if opts.attach is not None else None
    store, state = (attached.model_store if attached else root / "store"), root / "state"
    store.mkdir(exist_ok=True)
    linked = not (store / model).exists()  # an attached store may hold the archive already: kept
    if linked:
        (store / model).symlink_to(opts.model_dir.resolve(), target_is_directory=True)
    (state / "profiles").mkdir(parents=True)
    log.append("start-profile", start_profile(opts, state / "profiles" / f"{model}.json"))
    log.append("round-trip", round_trip(opts.clients, opts.round_trip_s))
    if attached is not None:
        server = attached
        slots = server.slot_dir or packrat_settings.value("slot_dir")  # what its workers write
    else:
        slots = root / "slots"
        server = start_torchserve(store, root / "ts", slot_dir=slots, extra_properties={"token_expiration_min": "480"})
    env = {packrat_settings.get("slot_dir").env: str(slots)}
    proc = None
    try:
        server.register(model, 1)
        port = free_port()
        proc = subprocess.Popen(_controller_cmd(server, state, port), env={**os.environ, **env},
                                stdout=subprocess.DEVNULL, stderr=open(root / "controller.log", "w"),
                                start_new_session=True)
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        texts = phases(opts.model_dir)
        sent = {name: sent_sizes(opts.model_dir, bodies) for name, (_, bodies) in texts.items()}
        yield Serving(server, f"http://127.0.0.1:{port}", state, model, log, opts, texts, sent)
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        if attached is not None:
            remove_model(server, store, model, base=linked)
        else:
            server.stop()


def run(opts: Options) -> list[dict[str, Any]]:
    """Every phase of every round, each record appended to opts.out_jsonl as measured."""
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop what we started (finally)
    try:
        return _run(opts)
    finally:
        signal.signal(signal.SIGTERM, old)


def _run(opts: Options) -> list[dict[str, Any]]:
    log = ResultLog(opts.out_jsonl)
    machine = describe_machine()
    log.append("run", {"command": opts.command or " ".join(sys.argv), "model_dir": str(opts.model_dir),
                       "machine": f"{machine.label}, {machine.cores} cores", "rounds": opts.rounds,
                       "clients": opts.clients, "window_s": opts.window_s, "hold_s": opts.hold_s,
                       "settle_timeout_s": opts.settle_timeout_s, "loadavg_start": os.getloadavg()[0]})
    out = []
    with tempfile.TemporaryDirectory(prefix="packrat-shape-") as tmp, serving(opts, Path(tmp), log) as sv:
        for rnd in range(1, opts.rounds + 1):
            for name in PHASES:
                out.append(run_phase(sv, rnd, name))
    log.append("end", {"loadavg_end": os.getloadavg()[0]})
    return out


# -- the results file --------------------------------------------------------------------


def spread(rows: list[dict[str, Any]], key: str) -> float | None:
    """Round-to-round spread of a figure of one phase: (max - min) / median."""
    vals = [v for v in (_get(r, key) for r in rows) if v]
    return round((max(vals) - min(vals)) / statistics.median(vals), 3) if len(vals) > 1 else None


def _get(rec: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        rec = rec.get(part) if isinstance(rec, dict) else None
    return rec


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per phase: the target's test (within +-25 %, or within the round-to-round noise band of
    the observed p50 where that is wider) on the median ratio over the rounds."""
    out = []
    for name, (texts, _) in PHASES.items():
        mine = [r for r in rows if r["phase"] == name]
        ratios = [r["ratio"] for r in mine if r["ratio"]]
        band = max(TARGET_BAND, spread(mine, "observed.p50_ms") or 0.0)
        ratio = statistics.median(ratios) if ratios else None
        out.append({"phase": name, "texts": texts, "ratio": None if ratio is None else round(ratio, 3),
                    "p50_spread": spread(mine, "observed.p50_ms"), "predicted_spread": spread(mine, "predicted.current_ms"),
                    "band": round(band, 3), "within": None if ratio is None else abs(ratio - 1.0) <= band,
                    "failed": sum(r["failed"] for r in mine), "swaps": sum(r["swaps"] for r in mine)})
    return out


ROW = ("| {round} | {phase} ({texts}) | {predicted_for} | {made} | {plan} B={batch} | {pred} | {corr} | {p50} | {p99} | "
       "{rps} | {ratio} | {sratio} | {settled} | {swaps} | {reprof} | {failed} |")


def _predicted_for(r: dict[str, Any]) -> str:
    """The profile's label, and the sizes the plan's instance batch was timed at where they differ."""
    label = r["predicted_for"]
    out = ", ".join(f"{k} {v}" for k, v in label.items()) or "task's sample"
    timed = (r.get("profile") or {}).get("timed_by_batch") or {}
    for b in r.get("instance_batches") or ():
        sizes = timed.get(str(b))
        if sizes and sizes != label:
            out += f"; batch {b} at " + ", ".join(f"{k} {v}" for k, v in sizes.items())
    return out


def table_row(r: dict[str, Any]) -> str:
    p, o, prof = r["predicted"], r["observed"], r.get("profile") or {}
    made = (f"{str(prof.get('created') or '?')[11:19]}, {prof.get('corrected', 0)} corrected / "
            f"{prof.get('contended', 0)} contended" if prof else "?")
    return ROW.format(
        round=r["round"], phase=r["phase"], texts=r["texts"],
        predicted_for=_predicted_for(r), made=made,
        plan=r["plan"], batch=p["estimated_batch"], pred=p["current_ms"], corr=p["corrected_current_ms"],
        p50=o["p50_ms"], p99=o["p99_ms"], rps=o["throughput_rps"], ratio=r["ratio"], sratio=r["service_ratio"],
        settled=f"{r['settled_after_s']} s" if r["settled"] else "no (timeout)", swaps=r["swaps"],
        reprof=len(r["reprofiles"]), failed=r["failed"])


def render(records: list[dict[str, Any]], took: tuple[float, float], plot_file: str | None = None) -> str:
    """The results file from the run's records: front matter (scripts/benchmark_summary.py
    reads it), the table per phase, the target's verdict per traffic shape, what is compared."""
    run_rec = next(r for r in records if r["kind"] == "run")
    rows = [r for r in records if r["kind"] == "phase"]
    rt = next((r for r in records if r["kind"] == "round-trip"), None)
    day = time.strftime("%Y-%m-%d %H:%M", time.gmtime(took[0]))
    vs = verdicts(rows)
    figures = "; ".join(f"{v['texts']}: observed p50 / predicted {v['ratio']} (band +-{v['band']:.0%}, "
                        f"{'within' if v['within'] else 'outside'})" for v in vs)
    lines = ["---", f"date: {day}-{time.strftime('%H:%M', time.gmtime(took[1]))} UTC",
             f"machine: {run_rec['machine']}", f"command: {run_rec['command']}",
             f"figures: {figures}; failed requests {sum(v['failed'] for v in vs)}", "---", "",
             "# Predicted against observed latency for two traffic shapes (issue 32, target 3)", "",
             __doc__.split("\n\n", 1)[1].strip(), "",
             "The load generator's own round trip at the same clients against a server that answers "
             f"at once: p50 {rt['p50_ms'] if rt else '?'} ms, p99 {rt['p99_ms'] if rt else '?'} ms.", "",
             "| round | phase | prediction for | profile made (UTC), points | plan at est. B | predicted ms | "
             "corrected ms | p50 ms | p99 ms | req/s | p50 / predicted | service / predicted | settled after | swaps | "
             "re-profiles | failed |",
             "|" + "---|" * 16]
    lines += [table_row(r) for r in rows]
    lines += ["", "| texts | median p50 / predicted | p50 spread | predicted spread | band | within | swaps | failed |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {v['texts']} | {v['ratio']} | {v['p50_spread']} | {v['predicted_spread']} | +-{v['band']:.0%} | "
              f"{v['within']} | {v['swaps']} | {v['failed']} |" for v in vs]
    if plot_file:
        lines += ["", f"![predicted batch latency, corrected, observed service and client p50 per round]({plot_file})"]
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """One panel per traffic shape: per round, the profile's predicted batch latency with the
    target's +-25 % band, the loop's corrected figure, the observed service time and the
    clients' p50 (the table's figures, drawn)."""
    import matplotlib

    matplotlib.use("Agg")  # a file only, never a display
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["kind"] == "phase"]
    names = sorted({r["phase"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(5.5 * max(1, len(names)), 4.8), squeeze=False)
    series = (("predicted (profile)", lambda r: r["predicted"]["current_ms"], "tab:blue"),
              ("corrected (loop)", lambda r: r["predicted"]["corrected_current_ms"], "tab:cyan"),
              ("observed service", lambda r: r["predicted"].get("observed_service_ms"), "tab:orange"),
              ("client p50", lambda r: r["observed"]["p50_ms"], "tab:red"))
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["phase"] == name]
        for k, r in enumerate(mine):
            pred = r["predicted"]["current_ms"]
            if pred:
                ax.fill_between([k - 0.4, k + 0.4], [(1 - TARGET_BAND) * pred] * 2, [(1 + TARGET_BAND) * pred] * 2, color="tab:blue",
                                alpha=0.12, label="predicted +-25 %" if k == 0 else None)
            for j, (label, get, color) in enumerate(series):
                value = get(r)
                if value:
                    ax.bar(k - 0.3 + 0.2 * j, value, width=0.18, color=color, label=label if k == 0 else None)
        ax.set_xticks(range(len(mine)), [f"round {r['round']}" for r in mine])
        ax.set_ylabel("ms")
        ax.set_title(f"{name}: {mine[0]['texts']}" if mine else name, fontsize=10)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    fig.suptitle("Predicted batch latency against what was served (8 closed-loop clients)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

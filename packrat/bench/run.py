"""The benchmark driver: for each model and load B, every configuration measured in one run.

    start TorchServe (or attach to one)
    measure the load generator against a no-op model and a trivial local server
    for each model:
        build its archive; take one sample request body from its handler
        profile it in isolation (nothing of ours is serving meanwhile)
        register it twice: as "<m>-defaults" the way TorchServe runs it untuned
            (T workers, torch's own thread counts, batch 1), and as "<m>" for plans
        with tuning on: tune "<m>" once (Controller.start_tune at the first B measured;
            the profile above is reused for the archive's own mode), which leaves one
            profile per execution mode (packrat.bench.tuned)
        for each B (middle, largest, smallest, then the rest):
            fat       1 worker, T threads, batch cap B       (applied as a plan)
            oracle    every other realisable uniform shape ⟨i, T/i, ⌈B/i⌉⟩
            packrat   the optimiser's realisable plan for B (live-plan swap)
            fat-tuned 1 worker, T threads, batch cap B, in the mode tuned for B
            tuned     the tuned (mode, plan) for B: plans_per_mode over the modes' profiles
            defaults  the idle "<m>-defaults" model
            -> each measured with B closed-loop clients
        unregister it

Every shape is applied through the controller's live-plan swap
(packrat.control.Controller.apply): fat and the oracle's candidates are plans too. A shape that is already live is
not swapped again. Each measurement is appended to results.jsonl the moment it
lands (see packrat.bench.results); reports read only that file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from packrat.apply.versions import batch_delay_ms
from packrat.bench.loadgen import LoadResult, Target, closed_loop
from packrat.bench.machine import describe_machine
from packrat.bench.results import CONFIGS, Measurement, ResultLog, shape_label
from packrat.bench.tuned import TUNED_CONFIGS, TunedPair
from packrat.errors import ConfigError, PackratError
from packrat.observe.metrics import window_means
from packrat.plan import every_uniform_plan
from packrat.types import Observation, Plan, Profile

# TorchServe's own default when default_workers_per_model is unset: one worker
# per available processor (ConfigManager.getDefaultWorkers in 0.12).
FULL_MODELS = ("bert-base", "gpt2", "resnet50")
FULL_BATCHES = (1, 2, 4, 8, 16, 32)
QUICK_MODELS = ("resnet50",)
QUICK_BATCHES = (1, 4, 8)
# Plans are measured from the largest B down: if the time budget runs out it is
# the small loads (cheap, and where thin instances matter least) that are skipped.
# Keys TorchServe hands out expire after 60 min by default; a full run is ~40 min
# of traffic plus set-up, so the bench's own server gets longer-lived keys.
TOKEN_EXPIRATION_MIN = 480


@dataclass(frozen=True)
class BenchSettings:
    models: tuple[str, ...]  # named architectures (packrat archive) or archive directories
    batches: tuple[int, ...]
    out: Path
    mode: str = "custom"  # "quick" | "full" | "custom": recorded only
    requests: int | None = None  # measured requests per point; None: max(min_requests, rounds*B)
    min_requests: int = 60
    rounds: int = 8  # measured requests per client
    warmup_rounds: int = 1
    # After a swap the retired workers are still exiting and the new ones meet their
    # first real batches: measured right away, the same shape read up to 2x slower
    # than a minute later (resnet50 B=8, busy machine). Wait, then warm up longer.
    settle_s: float = 5.0
    post_swap_warmup_rounds: int = 3
    max_point_s: float = 60.0  # one measurement's wall-time bound
    profile_budget_s: float = 150.0  # per model
    profile_point_budget_s: float = 8.0
    profile_path: Path | None = None  # reuse this profile instead of profiling (one model only)
    runtime: str = "eager"
    batch_delay_ms: int | None = None  # maxBatchDelay of every plan; None: Packrat's (versions.batch_delay_ms)
    configs: tuple[str, ...] = CONFIGS  # which of fat, defaults, packrat, oracle, fat-tuned, tuned to measure
    # Tune each model once (fat-tuned and tuned need it): Controller.start_tune at tune_batch
    # (None: the first B measured), profiles up to the largest B.
    tune: bool = False
    tune_budget_s: float | None = None  # per model; None: the tune's default (packrat.tune.DEFAULT_BUDGET_S)
    tune_modes: tuple[str, ...] | None = None  # None: the tune's short list for the task
    tune_point_budget_s: float | None = None  # None: the tune's default
    tune_batch: int | None = None
    attach: Path | None = None  # workdir of a TorchServe started by packrat.server
    cores: tuple[int, ...] | None = None  # default: this process's affinity
    capacity: bool = True
    capacity_requests: int = 600
    budget_s: float | None = None  # the whole run; steps past it are skipped (and noted)
    progress: bool = True
    command: str = ""

    @property
    def T(self) -> int:  # noqa: N802 (the design's name for the core count)
        return len(self.cores or ())

    @property
    def tuning(self) -> bool:
        """Tune each model: asked for, and a tuned configuration is to be measured."""
        return self.tune and any(c in self.configs for c in TUNED_CONFIGS)

    def point_requests(self, batch: int) -> tuple[int, int]:
        """(measured, warm-up) request counts for load B."""
        n = self.requests if self.requests is not None else max(self.min_requests, self.rounds * batch)
        return n, max(self.warmup_rounds * batch, 4)


def quick_settings(out: Path, **kw: Any) -> BenchSettings:
    base = dict(models=QUICK_MODELS, batches=QUICK_BATCHES, out=out, mode="quick", min_requests=40,
                rounds=5, max_point_s=25.0, profile_budget_s=90.0, profile_point_budget_s=4.0,
                capacity_requests=300)
    base.update(kw)
    return BenchSettings(**base)


def full_settings(out: Path, **kw: Any) -> BenchSettings:
    # Untuned ~40 min on 2 cores: 3 x (profile <= 2 min + ~12 swaps + ~24 measurements of <= 45 s).
    # Tuned adds per model a tune (<= 6 min: 2-3 modes besides the archive's own, whose
    # profile is reused, up to batch 32) and 2 x 6 measurements with their swaps (~12 min).
    tune = kw.get("tune", True)
    base = dict(models=FULL_MODELS, batches=FULL_BATCHES, out=out, mode="full",
                budget_s=(100 if tune else 40) * 60.0, tune=tune, tune_budget_s=360.0 if tune else None,
                min_requests=40, rounds=5, max_point_s=45.0, profile_budget_s=150.0,
                profile_point_budget_s=6.0)
    base.update({k: v for k, v in kw.items() if not (k == "tune_budget_s" and v is None)})
    return BenchSettings(**base)


# -- shapes ----------------------------------------------------------------------


def measure_order(batches: Sequence[int]) -> list[int]:
    """The loads in the order they are measured: the middle one, the largest, the smallest,
    then the rest from large to small.

    A run cut short by its time budget keeps whole rows (all four configurations at
    a B), spread over the range, with the large loads where thin instances matter
    most coming early.
    """
    rest = sorted(set(batches))
    if len(rest) <= 2:
        return rest[::-1]
    order = [rest[len(rest) // 2], rest[-1], rest[0]]
    return order + [b for b in reversed(rest) if b not in order]


def server_side(before: Observation | None, after: Observation | None) -> dict[str, float] | None:
    """Mean server-side latency split of the requests between two scrapes of one model.

    TorchServe counts a request's arrival -> response time (`mean_ms`) and its
    arrival -> taken-by-a-worker time (`queue_ms`); the difference (`worker_ms`)
    is the batch's time in the worker plus the frontend <-> worker hop, the part
    the profile predicts. Means over warm-up and measured requests alike (the
    counters cannot tell them apart); the client's p50 adds HTTP on top.
    """
    if before is None or after is None:
        return None
    w = window_means(before, after)
    if w.mean_latency_ms is None:
        return None
    out = {"requests": w.requests, "mean_ms": round(w.mean_latency_ms, 3)}
    if w.mean_queue_ms is not None:
        out["queue_ms"] = round(w.mean_queue_ms, 3)
        out["worker_ms"] = round(w.mean_latency_ms - w.mean_queue_ms, 3)
    return out


def predicted(plan: Plan) -> float | None:
    lats = [i.latency_ms for i in plan.instances]
    return max(lats) if lats and all(x > 0 for x in lats) else None


# -- machine ---------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    m = describe_machine()
    info = {
        "cpu": m.label,
        "flags": list(m.flags),
        "usable_cores": m.cores,
        "memory_gib": m.memory_gib,
        "python": m.python,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        import importlib.metadata as md

        info["torch"] = md.version("torch")
        info["torchserve"] = md.version("torchserve")
    except Exception:  # noqa: BLE001 - versions are informative only
        pass
    return info


# -- archives and request bodies ------------------------------------------------------


def prepare_archive(spec: str, model_store: Path, *, workers: int, runtime: str) -> tuple[str, Path]:
    """(model name, archive dir in `model_store`): a named architecture is built, a directory copied.

    The base archive is what a user would register without tuning: `workers`
    workers (TorchServe's default count), batch 1, no Packrat plan.
    """
    from packrat.archive import ArchiveOptions, build_named

    src = Path(spec)
    if src.is_dir():
        name = src.name
        dest = model_store / name
        if not dest.exists():
            shutil.copytree(src, dest, symlinks=True)
        return name, dest
    name = spec
    options = ArchiveOptions(workers=workers, batch_size=1, runtime=runtime)
    # An earlier (interrupted) run's copy in the same out dir is kept if its handler is
    # this checkout's; with another's it would measure old code, so it is rebuilt.
    return name, Path(build_named(spec, model_store, name, options, reuse_current=True))


_SAMPLE_SCRIPT = """
import sys, json, yaml, base64
sys.path.insert(0, sys.argv[1])
import packrat_handler
cfg = yaml.safe_load(open(sys.argv[1] + "/model_config.yaml")) or {}
req = packrat_handler.load_task(sys.argv[1], cfg).sample_requests(1)[0]
body = req.get("body") if req.get("body") is not None else req.get("data")
if isinstance(body, str):
    body = body.encode()
elif not isinstance(body, (bytes, bytearray)):
    body = json.dumps(body).encode()
print(json.dumps({"body": base64.b64encode(bytes(body)).decode(),
                  "content_type": req.get("content_type") or ""}))
"""


def sample_request(archive_dir: Path) -> tuple[bytes, str]:
    """One request body (and content type) from the archive's own handler, as the profiler times it.

    Run in a child process: it loads the model, which the bench process has no use for.
    """
    import base64

    proc = subprocess.run(
        [sys.executable, "-c", _SAMPLE_SCRIPT, str(archive_dir)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        raise ConfigError(f"cannot take a sample request from {archive_dir}: {proc.stderr[-2000:]}")
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    body = base64.b64decode(d["body"])
    ctype = d["content_type"] or _guess_content_type(body)
    return body, ctype


def _guess_content_type(body: bytes) -> str:
    head = body.lstrip()[:1]
    if head in (b"{", b"["):
        return "application/json"
    if body[:8] == b"\x89PNG\r\n\x1a\n" or body[:3] == b"\xff\xd8\xff":
        return "application/octet-stream"
    try:
        body.decode("utf-8")
        return "text/plain"
    except UnicodeDecodeError:
        return "application/octet-stream"


# -- the run ---------------------------------------------------------------------


@dataclass
class _State:
    """What is live for the model being measured (kept by the driver, checked against TorchServe)."""

    model: str
    base_url: str
    live_shape: tuple[tuple[int, int], ...] | None = None  # None: the plain base version
    registered: bool = False
    base_mode: str | None = None  # the archive's own execution mode
    live_mode: str | None = None  # the live version's mode (None: the base mode)

    def mode_of(self, plan: Plan) -> str | None:
        return plan.mode or self.base_mode


class Bench:
    def __init__(self, settings: BenchSettings) -> None:
        cores = settings.cores or tuple(sorted(os.sched_getaffinity(0)))
        self.s = replace(settings, cores=tuple(cores))
        self.out = Path(settings.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model_store = self.out / "model-store"
        self.model_store.mkdir(exist_ok=True)
        self.log = ResultLog(self.out / "results.jsonl")
        self.deadline = None if settings.budget_s is None else time.monotonic() + settings.budget_s
        self.server = None
        self._owns_server = False
        self._controller = None
        self._bar = None

    # -- helpers ------------------------------------------------------------------
    def say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        elif self.s.progress:
            print(text, file=sys.stderr, flush=True)

    def note(self, text: str, **kw: Any) -> None:
        self.log.append("note", {"text": text, **kw})
        self.say(f"note: {text}")

    def time_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def target(self, model: str, body: bytes, ctype: str) -> Target:
        # Keys are re-read for every measurement: TorchServe may have rotated them.
        return Target(
            url=f"{self.server.inference_url}/predictions/{model}",
            body=body,
            content_type=ctype,
            token=self.server.keys.inference.key,
            timeout_s=300.0,
        )

    # -- server ---------------------------------------------------------------------
    def start_server(self) -> None:
        from packrat.server import RunningServer, start_torchserve

        if self.s.attach:
            self.server = RunningServer.attach(self.s.attach)
            self.model_store = Path(self.server.model_store)
            return
        self.server = start_torchserve(
            self.model_store,
            self.out / "torchserve",
            extra_properties={"token_expiration_min": str(TOKEN_EXPIRATION_MIN)},
        )
        self._owns_server = True

    def stop_server(self) -> None:
        if self.server is not None and self._owns_server:
            self.server.stop()
        self.server = None
        self._controller = None

    def client(self):
        from packrat.apply.client import ManagementClient

        return ManagementClient(self.server.management_url, self.server.workdir / "key_file.json")

    # -- capacity -------------------------------------------------------------------
    def measure_capacity(self) -> None:
        """The generator against a no-op TorchServe model and a trivial local server."""
        from packrat.bench.localserver import LocalServer  # noqa: F401 (the child runs it)

        clients_list = [c for c in (1, 4, 16, 32) if c <= max(max(self.s.batches), 4)]
        name, _ = prepare_archive("noop", self.model_store, workers=self.s.T, runtime="eager")
        client = self.client()
        client.register(name, name, self.s.T)
        try:
            for c in clients_list:
                t = Target(f"{self.server.inference_url}/predictions/{name}", b"ping",
                           "application/octet-stream", self.server.keys.inference.key)
                res = closed_loop(t, c, self.s.capacity_requests, warmup=max(20, 2 * c))
                self.log.append("capacity", {"target": f"TorchServe noop ({self.s.T} workers)",
                                             "load": res.summary()})
                self.say(f"capacity noop@TorchServe clients={c}: {res.throughput_rps:.0f} req/s, "
                         f"p50 {res.p50_ms:.2f} ms, generator {res.generator_cpu_ms_per_request:.3f} ms CPU/req")
        finally:
            client.unregister(name, "1.0")
        proc = subprocess.Popen([sys.executable, "-m", "packrat.bench.localserver", "--port", "0"],
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline().split()[-1])
            for c in clients_list:
                t = Target(f"http://127.0.0.1:{port}/predictions/x", b"ping", "application/octet-stream", "x")
                res = closed_loop(t, c, self.s.capacity_requests, warmup=max(20, 2 * c))
                self.log.append("capacity", {"target": "trivial local HTTP server", "load": res.summary()})
                self.say(f"capacity local server clients={c}: {res.throughput_rps:.0f} req/s, "
                         f"generator {res.generator_cpu_ms_per_request:.3f} ms CPU/req")
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    # -- profile --------------------------------------------------------------------
    def profile(self, name: str, archive: Path) -> Profile:
        from packrat.profile import ProfileSettings, load_profile, open_archive, run_profile, save_profile

        path = self.out / "profiles" / f"{name}.json"
        if self.s.profile_path is not None:
            return load_profile(self.s.profile_path)
        if path.exists():
            prof = load_profile(path)
            if prof.extra.get("complete", True) is not False:
                self.say(f"{name}: reusing profile {path}")
                return prof
        path.parent.mkdir(parents=True, exist_ok=True)
        settings = ProfileSettings(
            cores=self.s.T,
            max_batch=max(self.s.batches),
            budget_s=min(self.s.profile_budget_s, max(self.time_left() * 0.3, 30.0)),
            point_budget_s=self.s.profile_point_budget_s,
        )
        t0 = time.monotonic()
        prof = run_profile(open_archive(archive), settings, progress=self.s.progress,
                           on_update=lambda p: save_profile(p, path), log_path=path.with_suffix(".log"))
        save_profile(prof, path)
        self.log.append("profile", {"model": name, "path": str(path), "seconds": round(time.monotonic() - t0, 1),
                                    "points": [[p.threads, p.batch, round(p.mean_ms, 3)] for p in prof.points],
                                    "omitted": prof.extra.get("omitted", [])})
        return prof

    # -- applying shapes ----------------------------------------------------------------
    def register_defaults(self, st: _State) -> None:
        client = self.client()
        client.register(st.base_url, st.model, self.s.T)
        st.registered = True
        st.live_shape = None

    def controller(self):
        """The Packrat controller on this TorchServe: every shape goes live through Controller.apply."""
        from packrat.apply.swap import SwapSettings
        from packrat.control import Controller, ControllerSettings

        if self._controller is None:
            self._controller = Controller(ControllerSettings(
                management_url=self.server.management_url,
                key_file=self.server.workdir / "key_file.json",
                model_store=self.model_store,
                state_dir=self.out / "controller",  # swaps.jsonl: every swap's phases and duration
                cores=tuple(self.s.cores),
                metrics_url=self.server.metrics_url,
                swap=SwapSettings(max_batch_delay_ms=self.s.batch_delay_ms),
            ))
        return self._controller

    def apply_plan(self, st: _State, plan: Plan) -> dict[str, Any] | None:
        """Make `plan` live through the live-plan swap, unless that shape is live already in its mode."""
        shape = plan.shape
        if st.live_shape == shape and (st.live_mode or st.base_mode) == st.mode_of(plan):
            return None
        record = self.controller().apply(st.model, plan)
        st.live_shape, st.live_mode = shape, st.mode_of(plan)
        return {"swap_s": record.duration_s, "phases_s": dict(record.phases_s), "to_version": record.to_version,
                "warnings": list(record.warnings)}

    def unregister_all(self, st: _State) -> None:
        from packrat.apply.versions import unregister_every_version

        unregister_every_version(self.client(), self.model_store, st.model, keep=st.base_url,
                                 on_error=lambda msg: self.note(msg, model=st.model))
        st.registered = False

    # -- measuring ------------------------------------------------------------------
    def server_counters(self, model: str) -> Observation | None:
        """TorchServe's own request counters for `model` (None if the metrics port does not answer)."""
        try:
            return self.controller().observe(model)
        except PackratError as exc:
            self.note(f"metrics scrape failed: {exc}", model=model)
            return None

    def measure(self, st: _State, batch: int, config: str, plan: Plan | None, target: Target,
                extra: dict[str, Any] | None = None, deadline: float | None = None,
                after_swap: bool = False) -> Measurement:
        mode = st.base_mode if plan is None else st.mode_of(plan)
        n, warm = self.s.point_requests(batch)
        if after_swap:
            time.sleep(self.s.settle_s)
            warm = max(warm, self.s.post_swap_warmup_rounds * batch)
        load_before = os.getloadavg()[0]
        bound = self.s.max_point_s
        if deadline is not None:
            bound = max(5.0, min(bound, deadline - time.monotonic()))
        before = self.server_counters(st.model)
        res: LoadResult = closed_loop(target, batch, n, warmup=warm, max_duration_s=bound)
        server = server_side(before, self.server_counters(st.model))
        if plan is None:
            inst: tuple[tuple[int, int], ...] = ()
            shape = f"defaults: {self.s.T} workers x torch threads, batch 1"
            pred = None
        else:
            inst = plan.shape
            shape = shape_label(inst)
            pred = predicted(plan)
        m = Measurement(
            model=st.model.removesuffix("-defaults"), batch=batch, config=config, shape=shape, instances=inst, predicted_ms=pred,
            load=res.summary(), mode=mode,
            extra={"loadavg_1m_before": round(load_before, 2), "requests": n, "warmup": warm,
                   **({"server": server} if server else {}), **(extra or {})},
        )
        self.log.measurement(m)
        missing = n - res.ok - res.errors
        self.say(
            f"{st.model:>10} B={batch:<3} {config:<9} {(mode or '') + ' ' + shape:<36} p50 {res.p50_ms or float('nan'):8.1f} ms"
            f"  p99 {res.p99_ms or float('nan'):8.1f}  {res.throughput_rps:7.1f} req/s"
            f"  pred {pred or float('nan'):7.1f}  err {res.errors}" + (f"  (cut short: {missing} not sent)" if missing else "")
        )
        return m

    # -- the loop ---------------------------------------------------------------------
    def steps_per_b(self, batch: int) -> int:
        return 2 + len(every_uniform_plan(self.s.T, batch, None)) + (len(TUNED_CONFIGS) if self.s.tuning else 0)

    def steps_per_model(self) -> int:
        return 1 + int(self.s.tuning) + sum(self.steps_per_b(b) for b in self.s.batches)

    def run(self) -> Path:
        from tqdm import tqdm

        from packrat.plan import realizable_plan

        self.log.append("run", {"command": self.s.command, "mode": self.s.mode, "machine": machine_info(),
                                "settings": {k: (str(v) if isinstance(v, Path) else v)
                                             for k, v in asdict(self.s).items()}})
        self.start_server()
        total = len(self.s.models) * self.steps_per_model()
        self._bar = tqdm(total=total, desc="bench", unit="step", dynamic_ncols=True, file=sys.stderr,
                         disable=not self.s.progress)
        try:
            if self.s.capacity:
                self._bar.set_postfix_str("load generator capacity")
                try:
                    self.measure_capacity()
                except PackratError as exc:
                    self.note(f"capacity measurement failed: {exc}")
            for k, spec in enumerate(self.s.models):
                models_left = len(self.s.models) - k
                model_deadline = time.monotonic() + self.time_left() / models_left
                self._one_model(spec, realizable_plan, model_deadline)
        finally:
            self._bar.close()
            self._bar = None
            self.stop_server()
        from packrat.bench.report import write_report

        write_report(self.log.path)
        return self.log.path

    def _one_model(self, spec: str, realizable_plan: Callable, model_deadline: float) -> None:
        from packrat.apply.versions import served_mode

        bar = self._bar
        bar.set_postfix_str(f"{spec}: archive + sample request")
        name, archive = prepare_archive(spec, self.model_store, workers=self.s.T, runtime=self.s.runtime)
        body, ctype = sample_request(archive)
        base_mode = served_mode(archive)
        self.log.append("model", {"model": name, "archive": str(archive), "content_type": ctype,
                                  "body_bytes": len(body), "mode": base_mode})
        bar.set_postfix_str(f"{name}: profiling")
        profile = self.profile(name, archive)
        bar.update(1)
        st = _State(model=name, base_url=archive.name, base_mode=base_mode)
        # The defaults live beside the plans as a model of their own (same archive, another
        # name), registered once and idle while the plans are measured: every B then gets
        # all configurations back to back, and a time cut loses whole B rows only.
        dst = _State(model=f"{name}-defaults", base_url=archive.name, base_mode=base_mode)
        try:
            bar.set_postfix_str(f"{name}: register")
            if "defaults" in self.s.configs:
                self.register_defaults(dst)
            # The plans' model starts from the plain archive with one worker; the first
            # plan (or the tune's choice) swaps it out.
            self.client().register(st.base_url, st.model, 1)
            st.registered = True
            tuned = False
            if self.s.tuning:
                tuned = self.tune(st, archive, profile, model_deadline)
                bar.update(1)
            for b in measure_order(self.s.batches):
                steps = self.steps_for(st, b, profile, realizable_plan, archive if tuned else None)
                skipped = [c for c, _, _ in steps if c not in self.s.configs]
                steps = [x for x in steps if x[0] in self.s.configs]
                bar.update(len(skipped))
                for config, plan, info in steps:
                    if time.monotonic() > model_deadline:
                        self.note("skipped: time budget", model=name, batch=b, config=config)
                        bar.update(1)
                        continue
                    if plan is None:
                        bar.set_postfix_str(f"{name} B={b} defaults")
                        self.measure(dst, b, "defaults", None, self.target(dst.model, body, ctype),
                                     deadline=model_deadline)
                        bar.update(1)
                        continue
                    bar.set_postfix_str(f"{name} B={b} {config} {st.mode_of(plan)} {shape_label(plan.shape)}")
                    try:
                        swap = self.apply_plan(st, plan)
                    except PackratError as exc:
                        self.note(f"could not apply {st.mode_of(plan)} {shape_label(plan.shape)}: {exc}",
                                  model=name, batch=b, config=config)
                        st.live_shape = "unknown"  # type: ignore[assignment]
                        bar.update(1)
                        continue
                    extra = {"swap": swap} if swap else {"swap": "none: shape already live"}
                    extra["batch_delay_ms"] = batch_delay_ms(plan, self.s.batch_delay_ms)
                    self.measure(st, b, config, plan, self.target(name, body, ctype), {**extra, **info},
                                 deadline=model_deadline, after_swap=swap is not None)
                    bar.update(1)
                bar.update(max(0, self.steps_per_b(b) - len(steps) - len(skipped)))
        finally:
            bar.set_postfix_str(f"{name}: unregister")
            self.unregister_all(st)
            self.unregister_all(dst)

    def steps_for(self, st: _State, batch: int, profile: Profile, realizable_plan: Callable,
                  tuned_from: Path | None) -> list[tuple[str, Plan | None, dict[str, Any]]]:
        """(config, plan, extra fields) to measure at load `batch`, in order; plan None: defaults.

        `tuned_from`: the base archive of a model the tune finished for (None: no tuned configs).
        """
        cands = every_uniform_plan(self.s.T, batch, profile)
        try:
            pk = realizable_plan(profile, self.s.T, batch)
        except PackratError as exc:
            self.note(f"no packrat plan: {exc}", model=st.model, batch=batch)
            pk = None
        base: list[tuple[str, Plan | None, dict[str, Any]]] = (
            [("fat", cands[0], {})] + [("oracle", p, {}) for p in cands[1:]])
        # The packrat plan comes right after the candidate of the same shape when there
        # is one, so it needs no swap of its own; it is still measured on its own.
        if pk is not None:
            same = [i for i, (_, p, _) in enumerate(base) if p is not None and p.shape == pk.shape]
            base.insert(same[0] + 1 if same else len(base), ("packrat", pk, {"fat_predicted_ms": pk.fat_latency_ms}))
        tuned: list[tuple[str, Plan | None, dict[str, Any]]] = []
        pair = self.tuned_pair(st, batch, tuned_from) if tuned_from is not None else None
        live = (st.live_mode or st.base_mode, st.live_shape)

        def is_live(step: tuple[str, Plan | None, dict[str, Any]]) -> bool:
            return step[1] is not None and (st.mode_of(step[1]), step[1].shape) == live

        if pair is not None:
            info = {"per_mode": list(pair.per_mode)}
            tuned = [("fat-tuned", pair.fat, info),
                     ("tuned", pair.tuned, {**info, "fat_predicted_ms": pair.tuned.fat_latency_ms})]
            if is_live(tuned[1]):
                tuned.reverse()  # e.g. the tune's own choice, still live: measured without a swap
        # What is live is measured first: it needs no swap (each swap loads new workers).
        tuned_first = any(is_live(x) for x in tuned) or (
            not any(is_live(x) for x in base) and st.live_mode not in (None, st.base_mode))
        return (tuned + base if tuned_first else base + tuned) + [("defaults", None, {})]

    # -- tuning -----------------------------------------------------------------------
    def tune(self, st: _State, archive: Path, profile: Profile, model_deadline: float) -> bool:
        """Tune `st.model` once through the controller; True when it finished (its choice is live).

        The bench's own profile is placed where the tune reuses it for the archive's own
        mode. The tune's record goes to results.jsonl (kind "tune")."""
        from packrat import tune as tuning
        from packrat.bench.tuned import run_tune, seed_base_profile, tune_summary

        ctl = self.controller()
        if st.base_mode:
            seed_base_profile(ctl.state_dir, st.model, st.base_mode, profile)
        batch = self.s.tune_batch or measure_order(self.s.batches)[0]
        # Leave at least half of the model's time to the measurements.
        budget = min(self.s.tune_budget_s or tuning.DEFAULT_BUDGET_S,
                     max(30.0, 0.5 * (model_deadline - time.monotonic())))
        self._bar.set_postfix_str(f"{st.model}: tuning (B={batch}, budget {budget:.0f} s)")
        try:
            out = run_tune(ctl, st.model, batch=batch, budget_s=budget, modes=self.s.tune_modes,
                           max_batch=max(batch, *self.s.batches), point_budget_s=self.s.tune_point_budget_s,
                           on_progress=lambda text: self._bar.set_postfix_str(f"{st.model}: {text}"[:150]))
        except PackratError as exc:
            self.note(f"tune not started: {exc}", model=st.model)
            return False
        self.log.append("tune", {"model": st.model, "seconds": out.seconds, "state": out.state,
                                 "error": out.error, **tune_summary(out.record)})
        choice = out.choice()
        self.say(f"{st.model}: tune {out.state} in {out.seconds:.0f} s"
                 + (f": {choice.mode} {shape_label(choice.shape)} at B={batch}" if choice else f": {out.error}"))
        try:  # what the tune left live (its choice, by a swap)
            live = ctl.model_state(st.model)
            st.live_shape = live.plan.shape if live.plan is not None else None
            st.live_mode = live.mode
        except PackratError:
            st.live_shape = "unknown"  # type: ignore[assignment]
        if not out.ok:
            self.note(f"tune {out.state}: {out.error}"[:500] + "; fat-tuned and tuned are not measured",
                      model=st.model)
        return out.ok

    def tuned_pair(self, st: _State, batch: int, archive: Path) -> TunedPair | None:
        """The tuned (mode, plan) and fat in that mode at `batch`, from the modes' profiles now."""
        from packrat.bench.tuned import mode_profiles_for, tuned_pair

        try:
            profiles = mode_profiles_for(self.controller().state_dir, st.model, archive, st.base_mode)
            return tuned_pair(profiles, self.s.T, batch)
        except (PackratError, OSError) as exc:
            self.note(f"no tuned plan: {exc}", model=st.model, batch=batch, config="tuned")
            return None

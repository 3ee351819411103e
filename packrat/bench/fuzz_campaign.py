"""The fuzz campaign (scripts/fuzz_inputs.py says what is sent and counted): fuzzed
requests of every task through a real TorchServe, three fuzzed beside one good request per
group so fuzz shares batches with good input, two groups in flight; then form-declared
bodies that TorchServe's frontend decodes itself, counted apart. The archives keep the
shipped default limits (checked, and recorded in the result with TorchServe's request
limit), and the workers' resident memory is read before and after.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import shutil
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from PIL import Image

from packrat.apply.client import session_for
from packrat.archive import ArchiveOptions, build_named
from packrat.bench.fuzz import DOCUMENTED, FORM_TYPES, TASKS, Fuzz, good_request, requests_for  # shared with the CI fuzz test
from packrat.bench.handler_code import handler_module
from packrat.bench.machine import describe_machine
from packrat.bench.mode_runs import rss_mb
from packrat.bench.stats import percentile
from packrat.server import RunningServer, start_torchserve

# TorchServe's frontend refuses bodies above max_request_size (6553500 bytes by
# default; config.properties, which `make run` and the campaign use, keeps it) with an
# empty 413 before any worker sees them.
FRONTEND_MAX_BYTES = 6_553_500
# Image limits an archive may override in its packrat: section (image.py); the campaign's
# archives must set none of them.
IMAGE_LIMITS = {"max_image_bytes": "MAX_IMAGE_BYTES", "max_image_pixels": "MAX_IMAGE_PIXELS",
                "max_aspect_ratio": "MAX_ASPECT_RATIO", "max_resized_pixels": "MAX_RESIZED_PIXELS",
                "max_decoded_pixels": "MAX_DECODED_PIXELS", "max_body_bytes": None}
BATCH = 4  # per version; each group: 3 fuzzed + 1 good request
GROUPS = 2  # groups in flight at once
ARCHIVES = {  # task -> (architecture, archive options): shipped default limits
    "noop": ("noop", ArchiveOptions(batch_size=BATCH, max_batch_delay_ms=50)),
    "text-classification": ("tiny-bert", ArchiveOptions(batch_size=BATCH, max_batch_delay_ms=50)),
    "feature-extraction": ("tiny-bert", ArchiveOptions(task="feature-extraction", batch_size=BATCH,
                                                       max_batch_delay_ms=50)),
    "text-generation": ("tiny-gpt2", ArchiveOptions(batch_size=BATCH, max_batch_delay_ms=50)),
    "image-classification": ("tiny-resnet", ArchiveOptions(batch_size=BATCH, max_batch_delay_ms=50)),
}
# Where the size probes aim: the handler's body limit where TorchServe lets such
# a body through, else TorchServe's own limit.
BODY_LIMITS = {"noop": FRONTEND_MAX_BYTES, "image-classification": FRONTEND_MAX_BYTES}


class Campaign:
    def __init__(self, server: RunningServer, models: dict[str, str]) -> None:
        self.server = server
        self.models = models
        self.headers = server.inference_headers()
        self.pool = ThreadPoolExecutor(BATCH * GROUPS)
        self.groups = ThreadPoolExecutor(GROUPS)
        self.in_flight = threading.Semaphore(GROUPS)
        self.lock = threading.Lock()
        self.submitted = 0
        self.pending: dict[str, list[Fuzz]] = defaultdict(list)
        self.counts: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.bad: list[dict] = []  # answers outside the documented set
        self.good_failed: list[dict] = []
        self.inputs = 0
        self.rounds = 0
        self.pids = {task: self.worker_pids(model) for task, model in models.items()}
        self.restarts: list[dict] = []
        self.loads: list[float] = []  # 1-minute load average at each worker check
        self.rss_start = self.worker_rss()
        # The large images (fuzz.large_images) by size and format as sent: who answered what.
        self.large: dict[str, Counter] = defaultdict(Counter)
        self.large_messages: dict[str, str] = {}  # "<image> <answer>" -> the first message

    def worker_pids(self, model: str) -> list[int]:
        return [w["pid"] for w in self.server.management_client().describe(model)["workers"]]

    def worker_rss(self) -> dict[str, list]:
        """task -> [resident MiB, peak resident MiB] of its (first) worker."""
        return {task: rss_mb(pids[0]) if pids else None for task, pids in self.pids.items()}

    def post(self, model: str, kwargs: dict) -> tuple[int, str, float]:
        headers = dict(self.headers, **kwargs.get("headers", {}))
        start = time.perf_counter()
        try:
            with session_for(self.server.inference_url) as direct:  # never via a proxy: the key
                r = direct.post(f"{self.server.inference_url}/predictions/{model}", data=kwargs["body"],
                                headers=headers, timeout=300)
            return r.status_code, r.text[:300], time.perf_counter() - start
        except requests.RequestException as exc:  # a dropped connection counts as a failure
            return -1, repr(exc)[:300], time.perf_counter() - start

    def add(self, task: str, fuzz: Fuzz) -> None:
        """Collect fuzz per task; send a group when BATCH - 1 are there."""
        self.pending[task].append(fuzz)
        if len(self.pending[task]) == BATCH - 1:
            self.send(task, self.pending.pop(task))

    def send(self, task: str, fuzzes: list[Fuzz]) -> None:
        """Queue one group (returns at once unless GROUPS are in flight)."""
        self.in_flight.acquire()
        self.submitted += len(fuzzes)
        self.groups.submit(self._group, task, fuzzes)

    def _group(self, task: str, fuzzes: list[Fuzz]) -> None:
        try:
            model = self.models[task]
            payloads = [f.kwargs() for f in fuzzes] + [good_request(task)]
            results = list(self.pool.map(lambda p: self.post(model, p), payloads))
            with self.lock:
                self.record(task, fuzzes, results)
                self.rounds += 1
                if self.rounds % 100 == 0:
                    self.check_workers()
                    print(f"{self.inputs} inputs, {len(self.bad)} undocumented, {len(self.restarts)} restarts",
                          flush=True)
        finally:
            self.in_flight.release()

    def record(self, task: str, fuzzes: list[Fuzz], results: list[tuple[int, str, float]]) -> None:
        for fuzz, (status, text, seconds) in zip(fuzzes, results):
            self.inputs += 1
            self.counts[task][fuzz.kind][str(status)] += 1
            self.latency[fuzz.kind].append(seconds)
            if "large" in fuzz.kind:
                self.count_large(fuzz, status, text)
            if not self.documented(fuzz, status, text):
                self.bad.append({"task": task, "fuzz": repr(fuzz), "status": status, "answer": text})
                print(f"UNDOCUMENTED {task} {fuzz!r} -> {status} {text[:200]}", flush=True)
        status, text, _ = results[-1]
        if status != 200:
            self.good_failed.append({"task": task, "status": status, "answer": text,
                                     "beside": [repr(f) for f in fuzzes]})

    def count_large(self, fuzz: Fuzz, status: int, text: str) -> None:
        image = large_label(fuzz.body)
        if status == 413 and len(fuzz.body) > FRONTEND_MAX_BYTES:
            answer = "413 TorchServe (body over max_request_size)"
        else:
            answer = str(status)
            try:
                self.large_messages.setdefault(f"{image} {answer}", json.loads(text)["message"][:160])
            except (ValueError, KeyError, TypeError):
                pass
        self.large[image][answer] += 1

    @staticmethod
    def documented(fuzz: Fuzz, status: int, text: str) -> bool:
        if status not in DOCUMENTED:
            return False
        if status == 413 and len(fuzz.body) > FRONTEND_MAX_BYTES:
            return True  # TorchServe's own refusal: no body
        if status != 200:
            try:
                return bool(json.loads(text)["message"])
            except (ValueError, KeyError, TypeError):
                return text.startswith("{")  # truncated to 300 characters above
        return True

    def check_workers(self) -> None:
        self.loads.append(round(os.getloadavg()[0], 1))
        for task, model in self.models.items():
            now = self.worker_pids(model)
            if now != self.pids[task]:
                self.restarts.append({"task": task, "before": self.pids[task], "after": now,
                                      "after_inputs": self.inputs})
                self.pids[task] = now

    def run(self, target: int, first_seed: int) -> None:
        strategies = {task: requests_for(task, BODY_LIMITS.get(task, 1 << 20), max_pixels=1_000_000, large=True)
                      for task in TASKS}
        round_seed = first_seed
        while self.submitted < target:  # hypothesis may stop a run early; go on with the next seed
            todo = target - self.submitted

            @seed(round_seed)
            @settings(max_examples=todo, database=None, deadline=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(st.data())
            def one_round(data) -> None:
                task = data.draw(st.sampled_from(TASKS))
                self.add(task, data.draw(strategies[task]))

            one_round()
            round_seed += 1
        for task, fuzzes in list(self.pending.items()):  # the last, partial groups
            if fuzzes:
                self.send(task, fuzzes)
        self.groups.shutdown(wait=True)
        self.check_workers()

    def frontend_probes(self, n: int, first_seed: int) -> dict:
        """Arbitrary bodies declared as form data, one at a time, counted apart."""
        counts: dict[str, Counter] = defaultdict(Counter)
        examples: list[dict] = []

        @seed(first_seed)
        @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(task=st.sampled_from(TASKS), body=st.binary(max_size=512), ctype=st.sampled_from(FORM_TYPES))
        def probe(task: str, body: bytes, ctype: str) -> None:
            status, text, _ = self.post(self.models[task], {"body": body, "headers": {"Content-Type": ctype}})
            counts[ctype][str(status)] += 1
            if status >= 500 and len(examples) < 5:
                examples.append({"task": task, "content_type": ctype, "body": repr(body[:100]),
                                 "status": status, "answer": text[:200]})

        probe()
        self.check_workers()
        return {"content_types": {k: dict(sorted(v.items())) for k, v in counts.items()},
                "inputs": sum(sum(v.values()) for v in counts.values()), "five_xx_examples": examples}


def run_campaign(inputs: int, first_seed: int, frontend_probes: int, workdir: Path, out: Path,
                 command: str) -> dict:
    """The campaign on its own TorchServe in `workdir` (emptied first); the result is written
    to `out` and returned."""
    shutil.rmtree(workdir, ignore_errors=True)
    store = workdir / "store"
    store.mkdir(parents=True)
    models = {}
    for task, (arch, options) in ARCHIVES.items():
        models[task] = f"fuzz-{task}"
        build_named(arch, store, models[task], options)
    server = start_torchserve(store, workdir / "ts", slot_dir=workdir / "slots")
    try:
        limits = limits_in_force(store, models, server.config_path)
        for model in models.values():
            server.register(model)
        load_before = os.getloadavg()
        started = time.time()
        campaign = Campaign(server, models)
        campaign.run(inputs, first_seed)
        duration = time.time() - started
        rss_end = campaign.worker_rss()
        restarts_in_campaign = len(campaign.restarts)
        frontend = campaign.frontend_probes(frontend_probes, first_seed)
        frontend["worker_restarts"] = len(campaign.restarts) - restarts_in_campaign
        load_after = os.getloadavg()
    finally:
        server.stop()
    result = {
        "command": command,
        "cpu": f"{describe_machine().label}, {os.cpu_count()} cores",
        "load_average_before_after": [round(load_before[0], 1), round(load_after[0], 1)],
        "load_average_sampled_min_max": [min(campaign.loads), max(campaign.loads)],
        "torch": __import__("torch").__version__,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(duration, 1),
        "seed": first_seed,
        "limits": limits,
        # [resident, peak resident] MiB of each task's worker after registration and after the
        # campaign (before the form probes): what the fuzzed batches added to the peak.
        "worker_rss_mb": {"start": campaign.rss_start, "end": rss_end},
        **_counted(campaign, restarts_in_campaign),
        "frontend_form_probes": frontend,
        "large_images": {k: dict(sorted(v.items())) for k, v in sorted(campaign.large.items())},
        "large_image_messages": dict(sorted(campaign.large_messages.items())),
        "latency_s_by_kind": {k: {"p50": round(percentile(v, 50), 3), "p99": round(percentile(v, 99), 3),
                                  "max": round(max(v), 3)} for k, v in sorted(campaign.latency.items())},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def large_label(body: bytes) -> str:
    """'<w>x<h> <format>' of the image in a request body (raw, or base64 in a JSON object,
    read leniently: the handler refuses the mangled forms, the label still names the
    image), from its header alone; 'no readable header' for one cut before its size."""
    try:
        if body.lstrip()[:1] == b"{":
            text = json.loads(body)["image"].split(",", 1)[-1]  # after a data: URL's comma
            body = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_" if "_" in text or "-" in text
                                    else None)
        with Image.open(io.BytesIO(body), formats=("JPEG", "PNG")) as img:
            progressive = " progressive" if img.info.get("progressive") else ""
            return f"{img.size[0]}x{img.size[1]} {img.format}{progressive}"
    except (ValueError, KeyError, TypeError, binascii.Error, OSError, SyntaxError, Image.DecompressionBombError):
        return "no readable header"


def limits_in_force(store: Path, models: dict[str, str], config_path: Path) -> dict:
    """The request and image limits the campaign runs at; refuses archives that override an
    image limit or a TorchServe config that moves max_request_size (not the defaults)."""
    for task, model in models.items():
        section = yaml.safe_load((store / model / "model_config.yaml").read_text()).get("packrat") or {}
        overridden = sorted(set(section) & set(IMAGE_LIMITS))
        if overridden:
            raise ValueError(f"{model}: overrides {overridden}; the campaign runs at the shipped defaults")
    properties = config_path.read_text()
    if "max_request_size" in properties:
        raise ValueError(f"{config_path} sets max_request_size; the campaign runs at TorchServe's default")
    image = handler_module("packrat_tasks.image")
    return {"torchserve_max_request_size": FRONTEND_MAX_BYTES,
            "image": {key: getattr(image, name) for key, name in IMAGE_LIMITS.items() if name}}


def _counted(campaign: Campaign, restarts_in_campaign: int) -> dict:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for kinds in campaign.counts.values():
        for kind, statuses in kinds.items():
            by_kind[kind].update(statuses)
    totals: Counter = Counter()
    for statuses in by_kind.values():
        totals.update(statuses)
    return {
        "inputs": campaign.inputs,
        "rounds": campaign.rounds,
        "statuses": dict(sorted(totals.items())),
        "five_xx": sum(v for k, v in totals.items() if k.startswith("5")),
        "undocumented": len(campaign.bad),
        "undocumented_examples": campaign.bad[:20],
        "good_requests_not_200": len(campaign.good_failed),
        "good_examples": campaign.good_failed[:10],
        "worker_restarts": restarts_in_campaign,
        "restarts": campaign.restarts,
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "by_task": {t: {k: dict(sorted(v.items())) for k, v in sorted(kinds.items())}
                    for t, kinds in sorted(campaign.counts.items())},
    }


def report(result: dict) -> str:
    """The summary line and the table by input class (docs/reliability.md)."""
    totals, frontend = result["statuses"], result["frontend_form_probes"]
    lines = [f"\n{result['inputs']} inputs in {result['duration_s']:.0f} s on {result['cpu']}: "
             f"{result['five_xx']} 5xx, {result['undocumented']} undocumented, "
             f"{result['worker_restarts']} worker restarts, {result['good_requests_not_200']} good requests not 200\n",
             "| input class | inputs | " + " | ".join(sorted(totals)) + " | p99 / max answer (s) |",
             "|---|---|" + "---|" * len(totals) + "---|"]
    for kind, statuses in result["by_kind"].items():
        lat = result["latency_s_by_kind"][kind]
        lines.append(f"| {kind} | {sum(statuses.values())} | "
                     + " | ".join(str(statuses.get(s, 0)) for s in sorted(totals)) + f" | {lat['p99']} / {lat['max']} |")
    lines.append(f"\nform-declared bodies (TorchServe's frontend, counted apart): {frontend['content_types']}, "
                 f"{frontend['worker_restarts']} worker restarts")
    if "worker_rss_mb" in result:  # results before the default-limit campaign lack these
        lines.append(f"limits: {result['limits']}\nworker [RSS, peak RSS] MiB, start: "
                     f"{result['worker_rss_mb']['start']}\nend: {result['worker_rss_mb']['end']}")
        lines += ["\n| large image (header) | answers |", "|---|---|"]
        lines += [f"| {image} | {', '.join(f'{n} x {a}' for a, n in answers.items())} |"
                  for image, answers in result["large_images"].items()]
    return "\n".join(lines)

"""Image decodes bounded at the shipped limits (handlers/packrat_tasks/image.py).

At the default config (an archive that sets no image limit) a 5000x5000 PNG and an
8000x8000 JPEG cost the worker a few milliseconds each: the PNG (no reduced decode)
is refused by max_decoded_pixels, the JPEG by max_image_pixels, both from the
header; a 5000x5000 baseline JPEG is decoded at 1/8 scale in the DCT (draft) and
answered. Through a real TorchServe the refused ones get their 413 naming the
limit while the rest of their batch is answered and the worker keeps its pid.
In a fresh worker-like process the parse of each is timed (CPU time) and a batch of
8 images at the allowed maximum is checked to add <= 300 MB to the peak RSS; the
figures are printed (docs/reliability.md quotes them).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from PIL import Image

from packrat.archive import ArchiveOptions, build_named
from serving_support import ensure_registered, worker_pids

MODEL = "decode-bounds-resnet"
BATCH, MAX_DELAY_MS = 4, 20_000  # the delay is a hang guard: four queued requests make the batch
DEFAULT_PIXELS = 25_000_000  # image.py MAX_IMAGE_PIXELS
DEFAULT_DECODED = 1 << 22  # image.py MAX_DECODED_PIXELS


def png(w: int, h: int, mode: str = "1") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h)).save(buf, "PNG")  # blank: megapixels in a few KiB, under every byte limit
    return buf.getvalue()


def jpeg(w: int, h: int, progressive: bool = False) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (40, 80, 120)).save(buf, "JPEG", quality=90, progressive=progressive)
    return buf.getvalue()


def good_jpeg(seed: int) -> bytes:
    from packrat_tasks.samples import sample_jpeg  # handlers/: on the path (pyproject's pythonpath)

    return sample_jpeg(320, 240, seed=seed)


@pytest.fixture(scope="module")
def archive(tiny_store: Path) -> Path:
    """tiny-resnet at the shipped limits (none set), batching 4."""
    build_named("tiny-resnet", tiny_store, MODEL, ArchiveOptions(batch_size=BATCH, max_batch_delay_ms=MAX_DELAY_MS))
    section = __import__("yaml").safe_load((tiny_store / MODEL / "model_config.yaml").read_text())["packrat"]
    assert not {k for k in section if k.startswith("max_")}, section  # really the defaults
    yield tiny_store / MODEL
    shutil.rmtree(tiny_store / MODEL, ignore_errors=True)


@pytest.mark.torchserve
def test_big_images_at_the_default_limits_are_refused_alone_in_their_batch(torchserve, archive: Path) -> None:
    ensure_registered(torchserve, MODEL)
    try:
        before = worker_pids(torchserve, MODEL)
        bodies = [png(5000, 5000), good_jpeg(1), jpeg(8000, 8000), jpeg(5000, 5000)]
        start = threading.Barrier(len(bodies))
        url, headers = f"{torchserve.inference_url}/predictions/{MODEL}", torchserve.inference_headers()

        def send(body: bytes) -> requests.Response:
            start.wait(60)
            return requests.post(url, data=body, headers=headers, timeout=MAX_DELAY_MS / 1000 + 120)

        with ThreadPoolExecutor(len(bodies)) as pool:
            big_png, good, big_jpeg, reduced = pool.map(send, bodies)
        assert [r.headers.get("x-packrat-batch-size") for r in (big_png, good, big_jpeg, reduced)] == \
            [str(BATCH)] * BATCH  # one batch: each answer carries the size of the batch it was in
        assert big_png.status_code == 413, big_png.text
        assert big_png.json()["message"] == (f"image is 5000x5000 PNG: decoded at full size, 25000000 pixels; "
                                             f"the limit is {DEFAULT_DECODED}")
        assert big_jpeg.status_code == 413, big_jpeg.text
        # over twice the limit: PIL's own check refuses it while reading the header
        assert big_jpeg.json()["message"] == f"image has more than twice the limit of {DEFAULT_PIXELS} pixels"
        for answered in (good, reduced):  # the 5000x5000 JPEG decoded at 1/8 scale
            assert answered.status_code == 200, answered.text
            assert "label" in answered.text
        assert worker_pids(torchserve, MODEL) == before
    finally:
        torchserve.management_client().unregister(MODEL, "1.0")


# A worker-like process: the archive's own task at its config, parse() timed in CPU time
# and the peak RSS read before and after a batch of 8 at the allowed maximum.
MEASURE = r"""
import io, json, sys, time
import yaml
archive = sys.argv[1]
sys.path.insert(0, archive)
import packrat_handler
from packrat_tasks.base import RequestError
task = packrat_handler.load_task(archive, yaml.safe_load(open(archive + "/model_config.yaml")))
bodies = json.loads(sys.stdin.read())

def parse(body):
    t0 = time.process_time()
    try:
        out, status = task.parse({"body": bytes.fromhex(body)}), 200
    except RequestError as exc:
        out, status = None, exc.status
    return out, status, (time.process_time() - t0) * 1000

def status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

parse(bodies["warm"])  # PIL's plugins imported, numpy's buffers made, as in a served worker
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # peak RSS (VmHWM) := current RSS: loading the model's peak is not the batch's
rss0 = status_kb("VmRSS")
kept = [parse(body) for body in bodies["batch"]]  # outputs kept, as a batch keeps them
rss1 = status_kb("VmHWM")
result = {"batch": {"statuses": [k[1] for k in kept], "cpu_ms": round(sum(k[2] for k in kept), 1),
                    "peak_rss_added_mb": round((rss1 - rss0) / 1024, 1)}}
for name, body in bodies["single"].items():
    result[name] = {"status": parse(body)[1], "cpu_ms": round(min(parse(body)[2] for _ in range(3)), 2)}
print(json.dumps(result))
"""


def test_decode_cost_at_the_default_limits(archive: Path) -> None:
    side = 2048  # the largest square PNG / progressive JPEG max_decoded_pixels lets through
    single = {"png 5000x5000": png(5000, 5000), "jpeg 8000x8000": jpeg(8000, 8000),
              "jpeg 5000x5000 (baseline)": jpeg(5000, 5000), "png 2048x2048 RGBA": png(side, side, "RGBA"),
              "jpeg 2048x2048 progressive": jpeg(side, side, progressive=True)}
    batch = [png(side, side, "RGBA"), jpeg(side, side, progressive=True), jpeg(5000, 5000), png(side, side, "RGB")] * 2
    payload = json.dumps({"single": {k: v.hex() for k, v in single.items()}, "batch": [b.hex() for b in batch],
                          "warm": good_jpeg(0).hex()})
    r = subprocess.run([sys.executable, "-c", MEASURE, str(archive)], input=payload, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    print("\ndecode cost at the default limits (CPU ms, min of 3):", json.dumps(figures, indent=1))
    assert figures["png 5000x5000"]["status"] == 413 and figures["jpeg 8000x8000"]["status"] == 413
    assert figures["jpeg 5000x5000 (baseline)"]["status"] == 200
    for name in ("png 5000x5000", "jpeg 8000x8000"):  # the target: < 20 ms of worker time each
        assert figures[name]["cpu_ms"] < 20, (name, figures[name])
    # decoded at 1/8 scale: 7-13 ms measured on a loaded 2-core EPYC (a full decode took 160 ms)
    assert figures["jpeg 5000x5000 (baseline)"]["cpu_ms"] < 40, figures
    assert figures["batch"]["statuses"] == [200] * 8
    assert figures["batch"]["peak_rss_added_mb"] <= 300, figures["batch"]

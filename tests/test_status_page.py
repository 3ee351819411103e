"""The controller's status page (GET /ui) in headless Chromium, against a live controller.

A real TorchServe (token auth on) serves the noop archive; a `packrat controller`
subprocess with the re-plan loop on (decisions every tick; no profile, so it
never swaps by itself) gets an explicit plan applied over REST, so the model has
a live plan and a swap record. The page is driven with selenium through Debian's
chromium + chromium-driver (.ci/run installs them; nothing is downloaded).

    PACKRAT_STATUS_SCREENSHOT=docs/status-page.png .venv/bin/python -m pytest -q tests/test_status_page.py

writes the committed screenshot.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import requests

from packrat.types import ms_text
from serving_support import noop_with_controller, usable_cores
from waiting import wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
MODEL = "page-echo"
PLAN = [{"threads": 1, "batch": 2}] * 2
SHAPE = "2 × 1t/b2"  # how the page writes PLAN (workers × threads/batch cap)
KEY_NAME = "packrat.managementKey"
WEB = Path(__file__).resolve().parents[1] / "packrat" / "web"

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    # Re-plan loop on (its decisions are the chart), but no swap of its own while the test
    # runs (--min-dwell); tuning off: it would profile for minutes. The synthetic profile
    # gives the plans a predicted latency.
    with noop_with_controller(tiny_store, tmp_path_factory.mktemp("page"), MODEL,
                              ["--no-tune", "--min-dwell", "3600"]) as (server, ctl):
        for plan in ([{"threads": 2, "batch": 1}], PLAN):  # two swaps: some history, the last one live
            r = requests.post(f"{ctl.url}/v1/models/{MODEL}/apply", json={"instances": plan},
                              headers=ctl.headers(), timeout=300)
            assert r.status_code == 200, r.text
        for i in range(12):  # observed latency and a load estimate
            requests.post(f"{server.inference_url}/predictions/{MODEL}", data=f"page {i}".encode(),
                          headers=server.inference_headers(), timeout=60).raise_for_status()
        yield server, ctl


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} missing: apt-get install -y chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    # An explicit driver and browser: selenium's driver manager is not asked to find (or fetch) one.
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(what, timeout_s: float = 60.0, step_s: float = 0.25):
    """Poll `what()` until it returns something truthy (waiting.wait_until: a hang guard)."""
    return wait_until(what, timeout_s, f"the page or controller: {what.__qualname__}", step_s)


def texts(driver, css: str) -> list[str]:
    """The text of every element `css` selects, read again if the page re-rendered one of
    them between the find and the read (its poll replaces a model's section)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def read() -> tuple[list[str]] | None:  # a tuple: an empty list is an answer too
        try:
            return ([e.text for e in driver.find_elements(By.CSS_SELECTOR, css)],)
        except StaleElementReferenceException:
            return None

    return wait_for(read, timeout_s=10, step_s=0.05)[0]


def click(driver, css: str) -> None:
    """Click the element `css` selects, found again if the page re-rendered it first."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def attempt() -> bool:
        try:
            driver.find_element(By.CSS_SELECTOR, css).click()
        except StaleElementReferenceException:
            return False
        return True

    wait_for(attempt, timeout_s=10, step_s=0.05)


def type_key(driver, key: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "key")
    box.clear()
    box.send_keys(key)
    click(driver, "#key-form button[type=submit]")


def test_page_files_are_static_and_write_no_markup_from_strings() -> None:
    """Server values reach the page only through textContent / setAttribute."""
    js = (WEB / "app.js").read_text()
    code = re.sub(r"^\s*//.*$", "", js, flags=re.M)  # the comments may name what is not used
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in code, sink
    html = (WEB / "index.html").read_text()
    assert "<script>" not in html and "style=" not in html  # nothing inline (the CSP forbids it)
    # Nothing from elsewhere (the SVG namespace is a name, not a fetch).
    for text in (html, js.replace("http://www.w3.org/2000/svg", ""), (WEB / "style.css").read_text()):
        assert "http://" not in text and "https://" not in text and "//" + "cdn" not in text


def test_page_and_healthz_need_no_token_the_data_does(stack) -> None:
    server, ctl = stack
    health = requests.get(f"{ctl.url}/healthz", timeout=10)
    assert health.status_code == 200, health.text
    assert health.json()["status"] == "ok" and health.json()["torchserve_reachable"] is True
    for path, kind in (("/ui", "text/html"), ("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
        r = requests.get(f"{ctl.url}{path}", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (path, r.status_code)
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert MODEL not in r.text  # no data in the page itself
    slash = requests.get(f"{ctl.url}/ui/", timeout=10, allow_redirects=False)  # typed with a slash
    assert slash.status_code == 308 and slash.headers["location"] == "/ui", (slash.status_code, slash.text)
    assert requests.get(f"{ctl.url}/ui/", timeout=10).headers["content-type"].startswith("text/html")
    # What the page calls is guarded as before.
    for path in ("/v1/models", f"/v1/models/{MODEL}/status", f"/v1/jobs?model={MODEL}"):
        assert requests.get(f"{ctl.url}{path}", timeout=10).status_code == 401
        assert requests.get(f"{ctl.url}{path}", headers=ctl.headers(), timeout=30).status_code == 200


def test_status_page_shows_the_live_plan_only_with_the_key(stack, browser) -> None:
    from selenium.webdriver.common.by import By

    server, ctl = stack
    driver = browser
    key = server.keys.management.key
    status = requests.get(f"{ctl.url}/v1/models/{MODEL}/status", headers=ctl.headers(), timeout=30).json()
    assert status["plan"] is not None and status["predicted_latency_ms"] > 0

    # Without the key: the form, and no model data, also after a poll period has passed.
    driver.get(f"{ctl.url}/ui")
    wait_for(lambda: driver.find_element(By.ID, "key").is_displayed())
    # (No wait for a poll here: without a key the page never polls, so waiting shows nothing.)
    assert driver.find_elements(By.CSS_SELECTOR, "section.model") == []
    assert MODEL not in driver.page_source and status["version"] not in driver.page_source

    # A wrong key: refused, forgotten, still nothing shown.
    type_key(driver, "not-the-key")
    wait_for(lambda: "refused" in driver.find_element(By.ID, "key-message").text)
    assert driver.execute_script(f"return sessionStorage.getItem('{KEY_NAME}')") is None
    assert driver.find_elements(By.CSS_SELECTOR, "section.model") == []

    # The management key: the model's live plan, version and swap appear.
    type_key(driver, key)
    section = f"section.model[data-model='{MODEL}']"
    wait_for(lambda: texts(driver, f"{section} dd.live-plan") == [SHAPE])
    assert texts(driver, f"{section} dd.live-version") == [status["version"]]
    # Nothing under way now; what the row says when a swap runs, or a last plan is to be
    # applied again after a restart (the page's own function on the controller's wire forms).
    assert texts(driver, f"{section} dd.under-way") == ["–"]
    plan = {"mode": "int8-onnxruntime", "instances": PLAN}
    swap = {"model": MODEL, "to_version": "p2", "phase": "drain", "plan": plan}
    assert driver.execute_script("return underWayText(arguments[0])", {"model": MODEL, "swap_in_progress": swap}) \
        == f"swapping to int8-onnxruntime {SHAPE} as version p2 (drain)"
    other = {**swap, "model": "another"}  # another model's swap is not this one's
    assert driver.execute_script("return underWayText(arguments[0])", {"model": MODEL, "swap_in_progress": other}) == "–"
    lost = {"version": "p1", "plan": {"instances": PLAN}}
    assert driver.execute_script("return underWayText(arguments[0])", {"model": MODEL, "lost_plan": lost}) \
        == f"to apply its last plan again ({SHAPE}: version p1 is no longer loaded)"
    assert texts(driver, f"{section} dd.predicted-latency") == [f"{ms_text(status['predicted_latency_ms'])} ms"]
    swaps = " ".join(texts(driver, f"{section} table.swaps"))
    assert status["last_swaps"][-1]["to_version"] in swaps and "applied" in swaps
    if status["last_swaps"][-1].get("phases_s"):  # swap records with per-phase timings
        assert next(iter(status["last_swaps"][-1]["phases_s"])) in swaps
    # The re-plan loop's decisions, drawn: a line in the batch chart.
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, f"{section} svg.chart path"), timeout_s=120)
    assert texts(driver, f"{section} dd.last-decision") != ["–"]
    # The key is in this tab's sessionStorage only: not in localStorage, a cookie or the DOM.
    assert driver.execute_script(f"return sessionStorage.getItem('{KEY_NAME}')") == key
    assert driver.execute_script("return localStorage.length") == 0 and driver.get_cookies() == []
    assert key not in driver.page_source

    # A full-page screenshot (docs/status-page.png is one, written with PACKRAT_STATUS_SCREENSHOT).
    # one more poll (its "updated" time changes): a few more decisions in the chart
    updated = texts(driver, "#updated")
    wait_for(lambda: texts(driver, "#updated") != updated, timeout_s=120)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1280, "height": min(height, 4000), "deviceScaleFactor": 1, "mobile": False})
    target = Path(os.environ.get("PACKRAT_STATUS_SCREENSHOT") or ctl.state / "status-page.png")
    assert driver.save_screenshot(str(target.resolve()))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

    # Forget the key: everything shown goes, and stays gone.
    driver.find_element(By.ID, "forget").click()
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "section.model") == [])
    assert driver.execute_script(f"return sessionStorage.getItem('{KEY_NAME}')") is None
    assert MODEL not in driver.page_source


@pytest.fixture
def lone_stack(tiny_store: Path, tmp_path: Path):
    """A TorchServe and controller of its own: the test below stops TorchServe."""
    with noop_with_controller(tiny_store, tmp_path, MODEL, ["--no-tune", "--no-adapt"],
                              profiled=False) as stack:
        yield stack


def test_healthz_is_503_when_torchserve_is_gone(lone_stack) -> None:
    """The liveness probe's other failure: TorchServe stopped under the controller."""
    server, ctl = lone_stack
    assert requests.get(f"{ctl.url}/healthz", timeout=10).status_code == 200
    server.stop()
    # (A requests.Response is falsy when not ok: wait for its status code instead.)
    wait_for(lambda: requests.get(f"{ctl.url}/healthz", timeout=10).status_code == 503)
    body = requests.get(f"{ctl.url}/healthz", timeout=10).json()
    assert body["status"] == "unhealthy" and body["torchserve_reachable"] is False
    assert any("TorchServe" in p for p in body["problems"]), body


def test_health_follows_the_tick_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Controller.health: not started, going round, then stuck in a tick (a dead or hung
    tick thread). Healthy is checked at the default staleness limit (at least 60 s, which
    no busy machine reaches between ticks 0.05 s apart); the limit is shrunk only once
    the tick really hangs, so "stuck" cannot come from a slow machine."""
    from packrat import control

    settings = control.ControllerSettings(management_url="http://127.0.0.1:9", key_file=tmp_path / "keys.json",
                                          model_store=tmp_path, state_dir=tmp_path / "state",
                                          cores=usable_cores(1), tick_s=0.05)
    ctl = control.Controller(settings)
    healthy, body = ctl.health()
    assert not healthy and body["problems"] == ["the tick loop is not running"]

    hang, stuck, release = threading.Event(), threading.Event(), threading.Event()
    ticks = []

    def tick() -> list[str]:
        ticks.append(time.monotonic())
        if hang.is_set():  # then hang, as a tick blocked on a call that never returns
            stuck.set()
            release.wait()
        return []

    monkeypatch.setattr(ctl, "tick", tick)
    stop = threading.Event()
    thread = threading.Thread(target=ctl.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(ticks) >= 2, timeout_s=60, step_s=0.01)
        healthy, body = ctl.health()
        assert healthy and body["problems"] == [] and body["tick_age_s"] < body["tick_stale_after_s"]
        hang.set()
        assert stuck.wait(60), "stuck: no tick ran after the hang was asked for"
        monkeypatch.setattr(control, "HEALTH_STALE_MIN_S", 0.5)
        healthy, body = wait_for(lambda: (lambda h: h if not h[0] else None)(ctl.health()), timeout_s=60)
        assert "its thread is dead or stuck" in body["problems"][0]
    finally:
        stop.set()
        release.set()
        thread.join(10)


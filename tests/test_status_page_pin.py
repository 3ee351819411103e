"""The status page shows a model's pin and changes it (headless Chromium, a live controller).

An apply over REST pins the model; the page shows the pin (mode, shape) and its
button unpins it, which the controller's status then says too; the button pins
what is live again. Same stack as tests/test_status_page.py (noop archive, a
`packrat controller` with the re-plan loop on, no swap of its own).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from serving_support import noop_with_controller
from test_status_page import browser, click, texts, type_key, wait_for  # noqa: F401 (browser: a fixture)

MODEL = "pin-echo"
SHAPE = "2 × 1t/b2"

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tiny_store: Path, tmp_path_factory: pytest.TempPathFactory):
    with noop_with_controller(tiny_store, tmp_path_factory.mktemp("pin-page"), MODEL,
                              ["--no-tune", "--min-dwell", "3600"]) as (server, ctl):
        yield server, ctl


def _pin(ctl) -> dict | None:
    return requests.get(f"{ctl.url}/v1/models/{MODEL}/status", headers=ctl.headers(), timeout=30).json()["pin"]


def test_the_page_shows_the_pin_and_its_button_changes_it(stack, browser) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    server, ctl = stack
    r = requests.post(f"{ctl.url}/v1/models/{MODEL}/apply", json={"instances": [{"threads": 1, "batch": 2}] * 2},
                      headers=ctl.headers(), timeout=300)
    assert r.status_code == 200, r.text
    mode = r.json()["pin"]["mode"]
    assert mode and _pin(ctl) == r.json()["pin"]

    driver = browser
    driver.get(f"{ctl.url}/ui")
    wait_for(lambda: driver.find_element(By.ID, "key").is_displayed())
    type_key(driver, server.keys.management.key)
    section = f"section.model[data-model='{MODEL}']"
    wait_for(lambda: [t.split(" since ")[0] for t in texts(driver, f"{section} dd.pin")] == [f"pinned: {mode} {SHAPE}"])

    click(driver, f"{section} button.pin-button")
    wait_for(lambda: texts(driver, f"{section} dd.pin") == ["not pinned"])
    assert _pin(ctl) is None
    assert texts(driver, f"{section} button.pin-button") == ["Pin what is live"]

    click(driver, f"{section} button.pin-button")
    wait_for(lambda: texts(driver, f"{section} dd.pin")[0].startswith(f"pinned: {mode} {SHAPE}"))
    pin = _pin(ctl)
    assert pin is not None and pin["mode"] == mode
    assert [(i["threads"], i["batch"]) for i in pin["plan"]["instances"]] == [(1, 2), (1, 2)]

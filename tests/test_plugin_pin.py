"""Pins through the management-port plugin: `/packrat/models/{m}/pin` and an apply with a
mode are forwarded like every other call (nothing in the plugin names routes), and both
ports agree on the pin. The stack is tests/test_plugin.py's (a TorchServe loading the
plugin, a `packrat controller` with the re-plan loop on that never swaps by itself)."""

from __future__ import annotations

import pytest

from test_plugin import MODEL, assert_same, both, stack, via_plugin  # noqa: F401 (stack: a fixture)

pytestmark = [pytest.mark.torchserve, pytest.mark.slow]


def test_pin_and_unpin_through_the_plugin(stack) -> None:  # noqa: F811
    server, ctl = stack
    own = via_plugin(server, "GET", f"/models/{MODEL}/status").json()["mode"]
    r = via_plugin(server, "POST", f"/models/{MODEL}/apply", {"instances": [{"threads": 1, "batch": 1}], "mode": own})
    assert r.status_code == 200, r.text
    assert r.json()["pin"]["mode"] == own
    a, b = both(server, ctl, "GET", f"/models/{MODEL}/status")
    assert a.json()["pin"] == b.json()["pin"] == r.json()["pin"]
    # Refused modes: the controller's 422 and reason, through the plugin as on its own port.
    a, b = both(server, ctl, "POST", f"/models/{MODEL}/apply", {"batch": 1, "mode": "fp64-eager"})
    assert a.status_code == 422 and "unknown mode" in a.json()["detail"]
    assert_same(a, b)
    # The loop is held off while pinned: switching it on is refused, off is kept for later.
    a, b = both(server, ctl, "PUT", f"/models/{MODEL}/adapt", {"enabled": True})
    assert a.status_code == 409 and "pinned" in a.json()["detail"]
    assert_same(a, b)
    r = via_plugin(server, "PUT", f"/models/{MODEL}/pin", {"pinned": False})
    assert r.status_code == 200 and r.json() == {"model": MODEL, "pinned": False, "pin": None}, r.text
    a, b = both(server, ctl, "GET", f"/models/{MODEL}/status")
    assert a.json()["pin"] is None and b.json()["pin"] is None
    a, b = both(server, ctl, "GET", f"/models/{MODEL}/adapt")
    assert a.json()["enabled"] is True  # given back: the loop was on before the pin
    r = via_plugin(server, "PUT", f"/models/{MODEL}/pin", {"pinned": True})
    assert r.status_code == 200 and r.json()["pinned"] is True and r.json()["pin"]["mode"] == own
    a, b = both(server, ctl, "PUT", f"/models/{MODEL}/pin", {"pinned": False})
    assert a.status_code == b.status_code == 200 and a.json() == b.json()

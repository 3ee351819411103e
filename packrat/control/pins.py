"""Operator pins: a model an operator set to a (mode, plan) stays so until unpinned.

An apply over REST pins its model (unless its body says `"pin": false`), and
`PUT /v1/models/{m}/pin {"pinned": true}` pins what is live now. While a model
is pinned:

  - the re-plan policy sees it switched off (packrat.observe.policy's "disabled"
    rule): it keeps estimating B, its decisions say "disabled", it swaps nothing;
  - the idle-footprint move (packrat.control.division) leaves it where it is;
  - the auto-tuner does not tune it, an explicit tune is refused (409), and a tune
    that was running when it was pinned does not apply its choice;
  - the restart watch still re-applies its plan after a TorchServe restart (the
    pinned plan is the last one applied).

`PUT .../pin {"pinned": false}` unpins it: the policy gets back the on/off
setting it had before the pin (or was given meanwhile: `PUT .../adapt
{"enabled": false}` is kept for then; `true` is refused while pinned), the
tuner may tune it again. Pins live in
<state dir>/pins.json, so they survive a controller restart; a pin is written
before its swap starts (nothing waiting for the swap lock, such as a tune's
choice, can slip in after the swap and before the pin) and taken back if the
swap fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from packrat.control.statefiles import StateFiles
from packrat.errors import BusyError, ConfigError
from packrat.types import Plan, Policy


class Pins:
    """pins.json: {model: {"mode", "plan", "since", "adapt_before"}}, read and written under a lock
    (REST requests, the tick and the tuner's thread all ask), and the policy's on/off switch
    held off while a model is pinned."""

    def __init__(self, files: StateFiles, policy: Policy | None, clock: Callable[[], float]) -> None:
        self.files, self.policy, self.clock = files, policy, clock
        self._lock = threading.Lock()

    def get(self, model: str) -> dict[str, Any] | None:
        with self._lock:
            return self.files.pins().get(model)

    def pinned(self, model: str) -> bool:
        return self.get(model) is not None

    def pin(self, model: str, plan: Plan | None, mode: str | None) -> dict[str, Any] | None:
        """Pin `model` to `plan` in `mode` and switch its re-plan policy off; returns the pin it
        replaces (None: it was not pinned), for restore()."""
        with self._lock:
            pins = self.files.pins()
            old = pins.get(model)
            # The policy's own setting, given back at unpin (an earlier pin already holds it off).
            adapt_before = old.get("adapt_before") if old is not None else self._adapting(model)
            pins[model] = {"mode": mode, "plan": plan.to_dict() if plan is not None else None,
                           "since": self.clock(), "adapt_before": adapt_before}
            self.files.save_pins(pins)
        self.hold(model)
        return old

    def restore(self, model: str, old: dict[str, Any] | None) -> None:
        """Put back the pin that pin() replaced (its swap failed)."""
        if old is None:
            self.unpin(model)
            return
        with self._lock:
            pins = self.files.pins()
            pins[model] = old
            self.files.save_pins(pins)

    def unpin(self, model: str) -> dict[str, Any] | None:
        """Remove `model`'s pin and give its policy back the setting it had before; returns the
        pin (None: it was not pinned)."""
        with self._lock:
            pins = self.files.pins()
            old = pins.pop(model, None)
            if old is None:
                return None
            self.files.save_pins(pins)
        if self.policy is not None:
            # Pinned by a controller without the loop: nothing was switched off but by the pin.
            before = old.get("adapt_before")
            self.policy.set_enabled(model, True if before is None else bool(before))
        return old

    def set_adapt(self, model: str, enabled: bool) -> None:
        """PUT /v1/models/{m}/adapt: switch the policy for `model`. While it is pinned, switching
        it off is kept for after the unpin; switching it on is BusyError (the pin holds it off)."""
        if self.policy is None:
            raise ConfigError("the re-plan loop is not running in this controller")
        with self._lock:
            pins = self.files.pins()
            if model in pins:
                if enabled:
                    raise BusyError(f"{model} is pinned by an operator: unpin it first "
                                    f'(PUT /v1/models/{model}/pin {{"pinned": false}})')
                pins[model]["adapt_before"] = False
                self.files.save_pins(pins)
                return
        self.policy.set_enabled(model, enabled)

    def hold(self, model: str) -> None:
        """Keep a pinned model's policy off (each tick: also after a restart, whatever
        policy-state.json says)."""
        if self.policy is not None and self.pinned(model) and self.policy.is_enabled(model):
            self.policy.set_enabled(model, False)

    def _adapting(self, model: str) -> bool | None:
        return self.policy.is_enabled(model) if self.policy is not None else None

"""`packrat apply` (a plan, optionally in a given execution mode, by the controller's swap;
it pins the model), `packrat pin` (pin what is live) and `packrat unpin`.

A pinned model is left as the operator set it: the re-plan loop and the tuner do
not change it until it is unpinned (docs/live-plans.md, "Pins"). These talk to a
running `packrat controller` (packrat.commands._client); defaults match `make run`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import typer

from packrat.commands._client import API, KEY_FILE, call, shape_text

# "2x(t1,b2)" or "2x(t1,b2) + 1x(t2,b2)": what `packrat status` prints.
_GROUP = re.compile(r"^\s*(\d+)\s*x\s*\(\s*t\s*(\d+)\s*,\s*b\s*(\d+)\s*\)\s*$")
# A swap starts workers and waits for them (minutes on a busy machine): the apply answers after it.
APPLY_TIMEOUT_S = 900.0


def parse_shape(text: str) -> list[dict[str, int]]:
    """"2x(t1,b2)" -> two instances of 1 thread, batch cap 2; typer.BadParameter when malformed."""
    out: list[dict[str, int]] = []
    for group in text.split("+"):
        m = _GROUP.match(group)
        if m is None:
            raise typer.BadParameter(f"{group.strip()!r} is not Nx(tT,bB), e.g. 2x(t1,b2)", param_hint="--shape")
        n, threads, batch = (int(x) for x in m.groups())
        out += [{"threads": threads, "batch": batch}] * n
    if not out:
        raise typer.BadParameter("no instances", param_hint="--shape")
    return out


def pin_text(model: str, pin: dict[str, Any] | None) -> str:
    if pin is None:
        return f"{model}: not pinned (the re-plan loop and the tuner may change it)"
    return f"{model}: pinned to {pin.get('mode') or 'its mode'} {shape_text(pin.get('plan'))}"


def apply_command(
    model: str = typer.Argument(..., help="model name as registered in TorchServe"),
    batch: Optional[int] = typer.Option(None, "--batch", min=1, help="plan for this load batch B from the profile"),
    shape: Optional[str] = typer.Option(None, "--shape", help="explicit workers, e.g. '2x(t1,b2)' (what "
                                                              "`packrat status` prints)"),
    mode: Optional[str] = typer.Option(None, "--mode", help="execution mode, e.g. fp32-eager [default: the live "
                                                            "mode]; refused when not run here or its guard failed"),
    pin: bool = typer.Option(True, "--pin/--no-pin", help="pin the model to it (the loop and the tuner leave it)"),
    wait: float = typer.Option(300.0, "--wait", min=0.0, help="seconds to wait while another swap runs (a tune's, "
                                                              "the re-plan loop's) before giving up"),
    api: str = API,
    key_file: Path = KEY_FILE,
) -> None:
    """Apply a plan to MODEL by a version swap (and pin it there, unless --no-pin)."""
    if (batch is None) == (shape is None):
        raise typer.BadParameter("give exactly one of --batch and --shape")
    body: dict[str, Any] = {"mode": mode, "pin": pin}
    body.update({"batch": batch} if batch is not None else {"instances": parse_shape(shape or "")})
    answer = call("POST", f"{api}/v1/models/{model}/apply", key_file, body, timeout_s=APPLY_TIMEOUT_S,
                  busy_wait_s=wait)
    swap = answer["swap"]
    typer.echo(f"{model}: version {swap['to_version']} {answer['plan'].get('mode') or 'live mode'} "
               f"{shape_text(answer['plan'])}: {swap['outcome']} in {swap.get('duration_s') or 0:.1f} s")
    typer.echo(pin_text(model, answer.get("pin")))


def pin_command(model: str = typer.Argument(..., help="model name as registered in TorchServe"),
                api: str = API, key_file: Path = KEY_FILE) -> None:
    """Pin MODEL to what is live now: the re-plan loop and the tuner leave it until unpinned."""
    answer = call("PUT", f"{api}/v1/models/{model}/pin", key_file, {"pinned": True})
    typer.echo(pin_text(model, answer["pin"]))


def unpin_command(model: str = typer.Argument(..., help="model name as registered in TorchServe"),
                  api: str = API, key_file: Path = KEY_FILE) -> None:
    """Unpin MODEL: the re-plan loop and the tuner may change it again."""
    answer = call("PUT", f"{api}/v1/models/{model}/pin", key_file, {"pinned": False})
    typer.echo(pin_text(model, answer["pin"]))


def register(app: typer.Typer) -> None:
    app.command("apply")(apply_command)
    app.command("pin")(pin_command)
    app.command("unpin")(unpin_command)

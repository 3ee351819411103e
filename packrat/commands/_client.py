"""Talking to a running `packrat controller` from the command line (tune, status, apply, pin).

Every call carries TorchServe's management key, read from the key file each
time (keys expire hourly), and goes only to a listener of the caller's own user
(packrat.listener). An error answer is one line on stderr and exit status 1.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from packrat import settings
from packrat.apply.keys import KEY_FILE_NAME
from packrat.errors import root_cause

# Where `make run` (scripts/run_demo.sh, in the checkout) says its controller listens:
# PACKRAT_FREE_PORTS=1 may pick another port than 8085. `make stop` removes it.
URL_FILE = Path(".packrat") / "controller.url"


def controller_api(given: str | None) -> str:
    """--api when given, else the URL in ./.packrat/controller.url (`make run`'s controller, while
    it runs), else the settings table's default (http://127.0.0.1:8085)."""
    if given:
        return given.rstrip("/")
    try:
        written = URL_FILE.read_text().strip()
    except OSError:
        written = ""
    return (written or settings.get("api_url").default).rstrip("/")


API = typer.Option(None, "--api", callback=controller_api, show_default=False,
                   help=f"the controller's REST API (default: the URL in {URL_FILE} while `make run`'s "
                        f"controller runs, else {settings.get('api_url').default})")
# In TorchServe's default working directory (`packrat torchserve start`, `make run`).
KEY_FILE = typer.Option(settings.get("ts_workdir").default / KEY_FILE_NAME, "--key-file",
                        help="TorchServe's key_file.json (the management key is the controller's token)")


def _headers(key_file: Path) -> dict[str, str]:
    from packrat.apply.keys import read_keys
    from packrat.errors import PackratError

    try:
        keys = read_keys(key_file)
    except (OSError, PackratError) as exc:
        missing = "" if Path(key_file).exists() else (
            "; TorchServe writes it when it starts (`make run` or `packrat torchserve start`; "
            "--key-file for another TorchServe's)")
        typer.echo(f"error: cannot read the management key: {exc}{missing}", err=True)
        raise typer.Exit(2) from None
    return keys.management.bearer()


def call(method: str, url: str, key_file: Path, body: Any = None, timeout_s: float = 60.0,
         busy_wait_s: float = 0.0) -> Any:
    """The controller's JSON answer to one request; exits (1) on an error answer or none.
    `busy_wait_s`: while the controller answers busy (409 BusyError: another swap runs, say
    a tune's), ask again once a second for up to that long, saying so once."""
    deadline = time.monotonic() + busy_wait_s
    said = False
    while True:
        status, answer = _ask(method, url, key_file, body, timeout_s)
        busy = status == 409 and isinstance(answer, dict) and answer.get("error") == "BusyError"
        if not busy or time.monotonic() >= deadline:
            break
        if not said:
            typer.echo(f"waiting (up to {busy_wait_s:.0f} s): {answer.get('detail')}", err=True)
            said = True
        time.sleep(1.0)
    if status >= 400:
        detail = answer.get("detail", answer) if isinstance(answer, dict) else answer
        typer.echo(f"error: HTTP {status}: {detail}", err=True)
        raise typer.Exit(1)
    return answer


def _ask(method: str, url: str, key_file: Path, body: Any, timeout_s: float) -> tuple[int, Any]:
    """(status, JSON answer) of one request; exits (1) where there is no answer or it is not JSON."""
    # The standard library's client, not requests: a `packrat status` is mostly start-up, and
    # importing requests was a large part of it (docs/benchmarks/cli-cost-status-urllib.md).
    import urllib.error
    import urllib.request
    from http.client import HTTPException

    from packrat.listener import untrusted_listener

    refused = untrusted_listener(url)  # before the key is read or sent
    if refused:
        typer.echo(f"error: {refused}. Another user may have taken the controller's port while it was "
                   "down: stop that process and start `packrat controller`.", err=True)
        raise typer.Exit(1)
    headers = {**_headers(key_file), "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with _opener(url).open(request, timeout=timeout_s) as r:
            status, ctype, raw = r.status, r.headers.get("Content-Type"), r.read()
    except urllib.error.HTTPError as exc:  # an error status is still the server's answer
        with exc:
            status, ctype, raw = exc.code, exc.headers.get("Content-Type"), exc.read()
    except (urllib.error.URLError, OSError, HTTPException) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        typer.echo(f"error: the controller at {url} does not answer ({root_cause(reason)}); is `packrat controller` "
                   "running?", err=True)
        raise typer.Exit(1) from None
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, (dict, list)):  # another server on the controller's port, say
        typer.echo(f"error: HTTP {status} from {url} is not the controller's answer (no JSON; "
                   f"{ctype or 'no content type'}): does another server listen there?", err=True)
        raise typer.Exit(1)
    return status, answer


def _opener(url: str) -> "urllib.request.OpenerDirector":
    """No redirect followed: the controller never redirects, so a 3xx is another server's
    answer, and following it would carry the management key to wherever it points. A
    loopback URL goes straight to the listener that untrusted_listener() checked, never
    through an HTTP proxy named in the environment (which would then receive the key);
    another host's the way the environment says (a proxy, say)."""
    import urllib.request

    from packrat.listener import loopback

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    proxies = urllib.request.ProxyHandler({}) if loopback(url) else urllib.request.ProxyHandler()
    return urllib.request.build_opener(proxies, NoRedirect())


def shape_text(plan: dict[str, Any] | None) -> str:
    """"2x(t1,b2)": workers x (threads, batch cap), the form `packrat apply --shape` takes."""
    if not plan:
        return "not a Packrat plan"
    groups: dict[tuple[int, int], int] = {}
    for i in plan["instances"]:
        groups[(i["threads"], i["batch"])] = groups.get((i["threads"], i["batch"]), 0) + 1
    return " + ".join(f"{n}x(t{t},b{b})" for (t, b), n in groups.items())
